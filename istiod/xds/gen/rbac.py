"""AuthorizationPolicy -> the RBAC HTTP filter (envoy.extensions.filters.http.rbac.v3) and, for
Envoy's TCP filter chains, the RBAC network filter, as istiod translates it, for every flavor's
inbound listeners. Pure.

DENY policies make one RBAC filter (action DENY, named `envoy.filters.http.rbac.deny`), ALLOW
policies another (`...rbac.allow`), in that order before the router; policies are named `ns[<ns>]-policy[<name>]-rule[<i>]` as istiod names
them. Only matchers that both Envoy and gRPC's xDS server (gRFC A41) evaluate are produced, except
requestPrincipals and `request.auth.*`, which only Envoy's HTTP chains check (`request_auth`: the
JWT payload jwt_authn leaves in dynamic metadata, matched as istiod matches it). A field that
cannot be checked (requestPrincipals and JWT claims without jwt_authn; hosts; path templates;
connection.sni; source.serviceAccount; experimental keys; and on TCP every HTTP-only field: methods,
paths, hosts, requestPrincipals, request.headers, request.auth.*) fails closed, as istiod's builder
does: an ALLOW rule using it is dropped (allows less), a DENY rule keeps its other conditions
(denies more). AUDIT has no effect on a decision and is left out; CUSTOM (an external authorizer)
is not implemented, so its rules deny. Each such case is reported.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from envoy.config.core.v3 import address_pb2
from envoy.config.rbac.v3 import rbac_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.config.listener.v3 import listener_components_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as http_rbac_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.filters.network.rbac.v3 import rbac_pb2 as network_rbac_pb2
from envoy.type.matcher.v3 import metadata_pb2, path_pb2, regex_pb2, string_pb2, value_pb2
from google.protobuf import wrappers_pb2

from istiod.model.config.security import Action, AuthorizationPolicy, Condition, Operation, Rule, Source
from istiod.xds.gen.authn import JWT_FILTER, JWT_PAYLOAD
from istiod.xds.gen.filters import network_filter, pack

RBAC_FILTER = "envoy.filters.http.rbac"
NETWORK_RBAC_FILTER = "envoy.filters.network.rbac"
_SPIFFE = "spiffe://"


class _Unsupported(Exception):
    """A field this translation cannot express; the message names it."""


@dataclass(frozen=True, slots=True)
class Authorization:
    filters: tuple[hcm_pb2.HttpFilter, ...]  # to run before the router, DENY first
    problems: tuple[str, ...]  # one line per policy field that was not translated as written


@dataclass(frozen=True, slots=True)
class TcpAuthorization:
    filters: tuple[listener_components_pb2.Filter, ...]  # to run before tcp_proxy, DENY first
    problems: tuple[str, ...]


def authorization_filters(policies: Iterable[AuthorizationPolicy], request_auth: bool = False) -> Authorization:
    """The RBAC HTTP filters for the policies that apply to a workload (see scope.policies_for);
    `request_auth`: a jwt_authn filter runs before them (Envoy), so JWT fields can be checked."""
    rules, problems = _rules(policies, for_tcp=False, request_auth=request_auth)
    # gRPC refuses two HTTP filters of one name (an HCM NACK), so each action has its own.
    return Authorization(tuple(
        hcm_pb2.HttpFilter(name=f"{RBAC_FILTER}.{rbac_pb2.RBAC.Action.Name(r.action).lower()}",
                           typed_config=pack(http_rbac_pb2.RBAC(rules=r))) for r in rules), problems)


def tcp_authorization_filters(policies: Iterable[AuthorizationPolicy]) -> TcpAuthorization:
    """The RBAC network filters for a workload's TCP filter chains: a denied connection is closed."""
    rules, problems = _rules(policies, for_tcp=True, request_auth=False)
    return TcpAuthorization(tuple(
        network_filter(NETWORK_RBAC_FILTER, network_rbac_pb2.RBAC(rules=r, stat_prefix="tcp.")) for r in rules), problems)


def _rules(policies: Iterable[AuthorizationPolicy], for_tcp: bool,
           request_auth: bool) -> tuple[list[rbac_pb2.RBAC], tuple[str, ...]]:
    deny: dict[str, rbac_pb2.Policy] = {}
    allow: dict[str, rbac_pb2.Policy] = {}
    has_allow = False
    problems: list[str] = []
    for policy in policies:
        where = f"AuthorizationPolicy {policy.meta}"
        if policy.action is Action.AUDIT:
            problems.append(f"{where}: AUDIT is not implemented; the policy has no effect")
            continue
        if policy.action is Action.CUSTOM:
            problems.append(f"{where}: CUSTOM (provider {policy.provider!r}) is not implemented; its rules deny")
        is_allow = policy.action is Action.ALLOW
        has_allow = has_allow or is_allow
        for i, rule in enumerate(policy.rules):
            name = f"ns[{policy.meta.namespace}]-policy[{policy.meta.name}]-rule[{i}]"
            try:
                translated = _policy(rule, _Collector(is_allow, for_tcp, request_auth))
            except _Unsupported as error:
                problems.append(f"{where} rules[{i}]: {error}; the rule is left out, allowing less")
                continue
            if translated.problems:
                problems += [f"{where} rules[{i}]: {p}; ignored, so the rule denies more" for p in translated.problems]
            (allow if is_allow else deny)[name] = translated.policy
    rules = []
    if deny:
        rules.append(rbac_pb2.RBAC(action=rbac_pb2.RBAC.DENY, policies=dict(sorted(deny.items()))))
    if has_allow:  # ALLOW policies whose rules match nothing (or none translated) deny every request
        rules.append(rbac_pb2.RBAC(action=rbac_pb2.RBAC.ALLOW, policies=dict(sorted(allow.items()))))
    return rules, tuple(problems)


@dataclass(frozen=True, slots=True)
class _Translated:
    policy: rbac_pb2.Policy
    problems: tuple[str, ...]


class _Collector:
    """Unsupported fields raise (strict: ALLOW) or are noted and skipped (DENY); `for_tcp`: a TCP
    filter chain, where HTTP-only fields cannot be checked; `request_auth`: JWT fields can be."""

    def __init__(self, strict: bool, for_tcp: bool = False, request_auth: bool = False) -> None:
        self.strict = strict
        self.for_tcp = for_tcp
        self.request_auth = request_auth and not for_tcp
        self.problems: list[str] = []

    def unsupported(self, what: str, reason: str = "is not supported") -> None:
        if self.strict:
            raise _Unsupported(f"{what} {reason}")
        self.problems.append(f"{what} {reason}")

    def http_only(self, what: str) -> bool:
        """True (after reporting it) when `what` cannot be checked on this TCP filter chain."""
        if self.for_tcp:
            self.unsupported(what, "is HTTP only (TCP port)")
        return self.for_tcp


def _policy(rule: Rule, c: _Collector) -> _Translated:
    principals = [_source(s, c) for s in rule.sources]
    permissions = [_operation(o, c) for o in rule.operations]
    principal_ands = [_or_ids(principals)] if principals else []
    permission_ands = [_or_rules(permissions)] if permissions else []
    for condition in rule.when:
        _condition(condition, c, principal_ands, permission_ands)
    return _Translated(
        rbac_pb2.Policy(principals=[_and_ids(principal_ands)], permissions=[_and_rules(permission_ands)]),
        tuple(c.problems),
    )


def _source(source: Source, c: _Collector) -> rbac_pb2.Principal:
    ands: list[rbac_pb2.Principal] = []

    def field(values: Sequence[str], negate: bool, build: Callable[[str], rbac_pb2.Principal]) -> None:
        if values:
            matched = _or_ids([build(v) for v in values])
            ands.append(rbac_pb2.Principal(not_id=matched) if negate else matched)

    field(source.principals, False, _principal)
    field(source.not_principals, True, _principal)
    field(source.namespaces, False, _namespace)
    field(source.not_namespaces, True, _namespace)
    field(source.ip_blocks, False, lambda v: rbac_pb2.Principal(direct_remote_ip=_cidr(v)))
    field(source.not_ip_blocks, True, lambda v: rbac_pb2.Principal(direct_remote_ip=_cidr(v)))
    field(source.remote_ip_blocks, False, lambda v: rbac_pb2.Principal(remote_ip=_cidr(v)))
    field(source.not_remote_ip_blocks, True, lambda v: rbac_pb2.Principal(remote_ip=_cidr(v)))
    if (source.request_principals or source.not_request_principals) and not c.http_only("from.source.requestPrincipals"):
        if c.request_auth:
            field(source.request_principals, False, _request_principal)
            field(source.not_request_principals, True, _request_principal)
        else:
            c.unsupported("from.source.requestPrincipals (RequestAuthentication)")
    return _and_ids(ands)


def _operation(operation: Operation, c: _Collector) -> rbac_pb2.Permission:
    ands: list[rbac_pb2.Permission] = []

    def field(values: Sequence[Any], negate: bool, build: Callable[[Any], rbac_pb2.Permission]) -> None:
        if values:
            matched = _or_rules([build(v) for v in values])
            ands.append(rbac_pb2.Permission(not_rule=matched) if negate else matched)

    field(operation.ports, False, lambda p: rbac_pb2.Permission(destination_port=p))
    field(operation.not_ports, True, lambda p: rbac_pb2.Permission(destination_port=p))
    if (operation.methods or operation.not_methods) and not c.http_only("to.operation.methods"):
        field(operation.methods, False, lambda m: rbac_pb2.Permission(header=_header(":method", m)))
        field(operation.not_methods, True, lambda m: rbac_pb2.Permission(header=_header(":method", m)))
    if (operation.paths or operation.not_paths) and not c.http_only("to.operation.paths"):
        for values, negate in ((operation.paths, False), (operation.not_paths, True)):
            if any("{" in p for p in values):
                c.unsupported("to.operation.paths with a template ({*} or {**})")
                values = tuple(p for p in values if "{" not in p)
            field(values, negate, _path)
    if (operation.hosts or operation.not_hosts) and not c.http_only("to.operation.hosts"):
        c.unsupported("to.operation.hosts")
    return _and_rules(ands)


def _condition(condition: Condition, c: _Collector, principals: list[rbac_pb2.Principal],
               permissions: list[rbac_pb2.Permission]) -> None:
    key = condition.key
    principal = {
        "source.ip": lambda v: rbac_pb2.Principal(direct_remote_ip=_cidr(v)),
        "remote.ip": lambda v: rbac_pb2.Principal(remote_ip=_cidr(v)),
        "source.namespace": _namespace,
        "source.principal": _principal,
    }.get(key)
    permission = {
        "destination.ip": lambda v: rbac_pb2.Permission(destination_ip=_cidr(v)),
        "destination.port": lambda v: rbac_pb2.Permission(destination_port=int(v)),
    }.get(key)
    if key.startswith("request.") and c.http_only(f"when.key {key}"):
        return
    if key.startswith("request.headers[") and key.endswith("]"):
        name = key[len("request.headers["):-1]
        principal = lambda v: rbac_pb2.Principal(header=_header(name, v))  # noqa: E731
    elif key.startswith("request.auth.") and c.request_auth:
        principal = _request_auth_attribute(key)
    if principal is not None:
        for values, negate in ((condition.values, False), (condition.not_values, True)):
            if values:
                matched = _or_ids([principal(v) for v in values])
                principals.append(rbac_pb2.Principal(not_id=matched) if negate else matched)
    elif permission is not None:
        for values, negate in ((condition.values, False), (condition.not_values, True)):
            if values:
                matched_p = _or_rules([permission(v) for v in values])
                permissions.append(rbac_pb2.Permission(not_rule=matched_p) if negate else matched_p)
    else:
        c.unsupported(f"when.key {key}")


def _request_auth_attribute(key: str) -> Callable[[str], rbac_pb2.Principal] | None:
    """`request.auth.principal`, `.audiences`, `.presenter`, `.claims[a][b]` as istiod matches them."""
    if key == "request.auth.principal":
        return _request_principal
    claims = {"request.auth.audiences": ["aud"], "request.auth.presenter": ["azp"]}.get(key)
    if key.startswith("request.auth.claims[") and key.endswith("]"):
        inner = key[len("request.auth.claims"):]
        nested = re.fullmatch(r"(\[[^\[\]]+\])+", inner)
        claims = re.findall(r"\[([^\[\]]+)\]", inner) if nested else [inner[1:-1]]
    if claims is None:
        return None
    path = claims
    # A claim may be a string or a list of strings (`aud`, `groups`): either matches.
    return lambda v: _jwt_claim(path, value_pb2.ValueMatcher(or_match=value_pb2.OrMatcher(value_matchers=[
        value_pb2.ValueMatcher(list_match=value_pb2.ListMatcher(one_of=value_pb2.ValueMatcher(string_match=_string(v)))),
        value_pb2.ValueMatcher(string_match=_string(v)),
    ])))


def _request_principal(value: str) -> rbac_pb2.Principal:
    """`<iss>/<sub>`, split at the last `/` (issuers are URLs), each half matched as istiod does."""
    iss, found, sub = value.rpartition("/")
    if not found:
        iss, sub = value, ""
    any_ = string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=".+"))
    if value == "*":
        match_iss, match_sub = any_, any_
    elif value.startswith("*"):
        if found:
            match_iss = any_ if iss == "*" else string_pb2.StringMatcher(suffix=iss[1:])
            match_sub = string_pb2.StringMatcher(exact=sub)
        else:
            match_iss, match_sub = any_, string_pb2.StringMatcher(suffix=value[1:])
    elif value.endswith("*"):
        if found:
            match_iss = string_pb2.StringMatcher(exact=iss)
            match_sub = any_ if sub == "*" else string_pb2.StringMatcher(prefix=sub[:-1])
        else:
            match_iss, match_sub = string_pb2.StringMatcher(prefix=value[:-1]), any_
    else:
        match_iss, match_sub = string_pb2.StringMatcher(exact=iss), string_pb2.StringMatcher(exact=sub)
    return _and_ids([_jwt_claim(["iss"], value_pb2.ValueMatcher(string_match=match_iss)),
                     _jwt_claim(["sub"], value_pb2.ValueMatcher(string_match=match_sub))])


def _jwt_claim(path: Sequence[str], value: value_pb2.ValueMatcher) -> rbac_pb2.Principal:
    """A claim of the verified token's payload, which jwt_authn leaves in dynamic metadata."""
    segments = [metadata_pb2.MetadataMatcher.PathSegment(key=k) for k in (JWT_PAYLOAD, *path)]
    return rbac_pb2.Principal(metadata=metadata_pb2.MetadataMatcher(filter=JWT_FILTER, path=segments, value=value))


def _string(value: str, prefix: str = "") -> string_pb2.StringMatcher:
    """istiod's matching of policy values: `*` any non-empty, `x*` prefix, `*x` suffix, else exact."""
    if value == "*":
        return string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=".+"))
    if value.endswith("*"):
        return string_pb2.StringMatcher(prefix=prefix + value[:-1])
    if value.startswith("*"):
        return string_pb2.StringMatcher(suffix=value[1:])
    return string_pb2.StringMatcher(exact=prefix + value)


def _principal(value: str) -> rbac_pb2.Principal:
    # Policies name identities without the scheme; certificates carry spiffe:// URIs.
    return rbac_pb2.Principal(authenticated=rbac_pb2.Principal.Authenticated(principal_name=_string(value, _SPIFFE)))


def _namespace(value: str) -> rbac_pb2.Principal:
    body = _re2_escape(value.strip("*"))
    body = (".*" if value.startswith("*") else "") + body + (".*" if value.endswith("*") and value != "*" else "")
    if value == "*":
        body = ".+"
    matcher = string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=f".*/ns/{body}/.*"))
    return rbac_pb2.Principal(authenticated=rbac_pb2.Principal.Authenticated(principal_name=matcher))


def _path(value: str) -> rbac_pb2.Permission:
    return rbac_pb2.Permission(url_path=path_pb2.PathMatcher(path=_string(value)))


def _header(name: str, value: str) -> route_components_pb2.HeaderMatcher:
    if value == "*":
        return route_components_pb2.HeaderMatcher(name=name, present_match=True)
    return route_components_pb2.HeaderMatcher(name=name, string_match=_string(value))


def _cidr(value: str) -> address_pb2.CidrRange:
    network = ipaddress.ip_network(value, strict=False)
    return address_pb2.CidrRange(address_prefix=str(network.network_address),
                                 prefix_len=wrappers_pb2.UInt32Value(value=network.prefixlen))


def _re2_escape(text: str) -> str:
    return "".join("\\" + ch if ch in r".^$*+?()[]{}|\-" else ch for ch in text)


M = TypeVar("M", rbac_pb2.Principal, rbac_pb2.Permission)


def _joined(cls: type[M], how: str, items: list[M]) -> M:
    """One matcher for all (`and`) or any (`or`) of `items`; all of none is `any`."""
    if len(items) == 1:
        return items[0]
    if not items:
        return cls(any=True)
    if cls is rbac_pb2.Principal:
        return cls(**{f"{how}_ids": rbac_pb2.Principal.Set(ids=items)})
    return cls(**{f"{how}_rules": rbac_pb2.Permission.Set(rules=items)})


_or_ids = partial(_joined, rbac_pb2.Principal, "or")
_and_ids = partial(_joined, rbac_pb2.Principal, "and")
_or_rules = partial(_joined, rbac_pb2.Permission, "or")
_and_rules = partial(_joined, rbac_pb2.Permission, "and")

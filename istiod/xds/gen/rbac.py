"""AuthorizationPolicy -> the RBAC HTTP filter (envoy.extensions.filters.http.rbac.v3) and, for
Envoy's TCP filter chains, the RBAC network filter, as istiod's authz builder translates it, for
every flavor's inbound listeners (and gateways). Pure.

In istiod's order: CUSTOM (a shadow RBAC marking requests for the provider's ext_authz filter, see
extauthz.py), AUDIT (action LOG), DENY, ALLOW; one filter per action, named
`envoy.filters.http.rbac.<custom|log|deny|allow>` (gRPC refuses two HTTP filters of one name);
policies named `ns[<ns>]-policy[<name>]-rule[<i>]` as istiod names them. `proxyless`: gRPC's RBAC
(gRFC A41) lacks path templates, SNI and dynamic metadata (experimental.envoy.filters.*), LOG and
ext_authz; `request_auth`: a jwt_authn filter runs before (Envoy), so requestPrincipals and
`request.auth.*` can be checked on the JWT payload it leaves in dynamic metadata. A field that
cannot be checked (those, and on TCP every HTTP-only field: methods, paths, hosts,
requestPrincipals, request.headers, request.auth.*) fails closed, as istiod's builder does: an
ALLOW rule using it is dropped (allows less), a DENY (AUDIT, CUSTOM) rule keeps its other
conditions (matches more). Each such case is reported.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from envoy.config.core.v3 import address_pb2, extension_pb2
from envoy.config.rbac.v3 import rbac_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.config.listener.v3 import listener_components_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as http_rbac_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.filters.network.rbac.v3 import rbac_pb2 as network_rbac_pb2
from envoy.extensions.path.match.uri_template.v3 import uri_template_match_pb2
from envoy.type.matcher.v3 import filter_state_pb2, metadata_pb2, path_pb2, regex_pb2, string_pb2, value_pb2
from google.protobuf import wrappers_pb2

from istiod.model.config.security import Action, AuthorizationPolicy, Condition, Operation, Rule, Source
from istiod.xds.gen.authn import payload_matcher, string_or_list
from istiod.xds.gen.extauthz import (
    EXT_AUTHZ_FILTER, EXT_AUTHZ_MATCH_PREFIX, NETWORK_EXT_AUTHZ_FILTER, SHADOW_STAT_PREFIX, ResolvedProvider,
    http_ext_authz, network_ext_authz,
)
from istiod.xds.gen.filters import network_filter, pack

RBAC_FILTER = "envoy.filters.http.rbac"
NETWORK_RBAC_FILTER = "envoy.filters.network.rbac"
_SPIFFE = "spiffe://"
# Where a waypoint keeps the caller's identity (its certificate's URI SAN) for the listener behind
# HBONE's termination, which no longer sees the certificate: istiod's key.
PEER_PRINCIPAL_STATE = "io.istio.peer_principal"


class _Unsupported(Exception):
    """A field this translation cannot express; the message names it."""


@dataclass(frozen=True, slots=True)
class Authorization:
    filters: tuple[hcm_pb2.HttpFilter, ...]  # to run before the router: CUSTOM, AUDIT, DENY, ALLOW
    problems: tuple[str, ...]  # one line per policy field that was not translated as written


@dataclass(frozen=True, slots=True)
class TcpAuthorization:
    filters: tuple[listener_components_pb2.Filter, ...]  # to run before tcp_proxy, in the same order
    problems: tuple[str, ...]


def custom_providers(policies: Iterable[AuthorizationPolicy]) -> tuple[str, ...]:
    """The extension providers the CUSTOM policies name (to resolve with extauthz.resolve_providers)."""
    return tuple(sorted({p.provider for p in policies if p.action is Action.CUSTOM}))


def authorization_filters(policies: Iterable[AuthorizationPolicy], request_auth: bool = False,
                          proxyless: bool = False, providers: Mapping[str, ResolvedProvider] | None = None,
                          peer_state: bool = False) -> Authorization:
    """The RBAC (and ext_authz) HTTP filters for the policies that apply to a workload (see
    scope.policies_for); `request_auth`: a jwt_authn filter runs before them (Envoy), so JWT
    fields can be checked; `proxyless`: for gRPC's RBAC filter, which lacks some of Envoy's
    matchers, AUDIT's LOG action and ext_authz; `providers`: CUSTOM policies' resolved providers;
    `peer_state`: the caller's identity is the filter state PEER_PRINCIPAL_STATE rather than the
    connection's certificate (a waypoint's internal listener)."""
    built = _build(tuple(policies), for_tcp=False, request_auth=request_auth, proxyless=proxyless,
                   providers=providers or {}, peer_state=peer_state)
    filters = []
    for rules, shadow, ext_authz in built.parts:
        # gRPC refuses two HTTP filters of one name (an HCM NACK), so each action has its own.
        suffix = "custom" if shadow is not None else rbac_pb2.RBAC.Action.Name(rules.action).lower()
        config = http_rbac_pb2.RBAC(rules=rules) if shadow is None else http_rbac_pb2.RBAC(
            shadow_rules=shadow, shadow_rules_stat_prefix=SHADOW_STAT_PREFIX)
        filters.append(hcm_pb2.HttpFilter(name=f"{RBAC_FILTER}.{suffix}", typed_config=pack(config)))
        if ext_authz is not None:
            filters.append(hcm_pb2.HttpFilter(name=EXT_AUTHZ_FILTER,
                                              typed_config=pack(http_ext_authz(ext_authz, RBAC_FILTER))))
    return Authorization(tuple(filters), built.problems)


def tcp_authorization_filters(policies: Iterable[AuthorizationPolicy],
                              providers: Mapping[str, ResolvedProvider] | None = None,
                              peer_state: bool = False) -> TcpAuthorization:
    """The RBAC (and ext_authz) network filters for a workload's TCP filter chains: a denied
    connection is closed. `peer_state`: as authorization_filters."""
    built = _build(tuple(policies), for_tcp=True, request_auth=False, proxyless=False, providers=providers or {},
                   peer_state=peer_state)
    filters = []
    for rules, shadow, ext_authz in built.parts:
        if ext_authz is None:
            filters.append(network_filter(NETWORK_RBAC_FILTER, network_rbac_pb2.RBAC(rules=rules, stat_prefix="tcp.")))
        elif (config := network_ext_authz(ext_authz, NETWORK_RBAC_FILTER)) is not None:
            filters += [network_filter(NETWORK_RBAC_FILTER, network_rbac_pb2.RBAC(
                            shadow_rules=shadow, stat_prefix="tcp.", shadow_rules_stat_prefix=SHADOW_STAT_PREFIX)),
                        network_filter(NETWORK_EXT_AUTHZ_FILTER, config)]
        # An HTTP provider has no TCP filter: istiod leaves CUSTOM out of TCP chains then.
    return TcpAuthorization(tuple(filters), built.problems)


@dataclass(frozen=True, slots=True)
class _Built:
    # (rules, shadow rules, provider): an enforcing RBAC, or a CUSTOM provider's shadow RBAC
    # and the provider whose ext_authz filter follows it.
    parts: tuple[tuple[rbac_pb2.RBAC, rbac_pb2.RBAC | None, ResolvedProvider | None], ...]
    problems: tuple[str, ...]


def _build(policies: tuple[AuthorizationPolicy, ...], for_tcp: bool, request_auth: bool, proxyless: bool,
           providers: Mapping[str, ResolvedProvider], peer_state: bool = False) -> _Built:
    """istiod's order: CUSTOM, then AUDIT (LOG), DENY, ALLOW."""
    problems: list[str] = []
    parts: list[tuple[rbac_pb2.RBAC, rbac_pb2.RBAC | None, ResolvedProvider | None]] = []

    def translate(action: Action, strict: bool, prefix: str = "",
                  only: Iterable[AuthorizationPolicy] | None = None) -> dict[str, rbac_pb2.Policy]:
        translated: dict[str, rbac_pb2.Policy] = {}
        chosen = [p for p in policies if p.action is action] if only is None else list(only)
        for policy in chosen:
            where = f"AuthorizationPolicy {policy.meta}"
            for i, rule in enumerate(policy.rules):
                name = f"{prefix}ns[{policy.meta.namespace}]-policy[{policy.meta.name}]-rule[{i}]"
                try:
                    result = _policy(rule, _Collector(strict, policy.meta.namespace, for_tcp, request_auth, proxyless,
                                                      peer_state))
                except _Unsupported as error:
                    problems.append(f"{where} rules[{i}]: {error}; the rule is left out, allowing less")
                    continue
                problems.extend(f"{where} rules[{i}]: {p}; ignored, so the rule "
                                f"{'logs' if action is Action.AUDIT else 'denies'} more" for p in result.problems)
                translated[name] = result.policy
        return dict(sorted(translated.items()))

    custom = [p for p in policies if p.action is Action.CUSTOM]
    deny_extra: dict[str, rbac_pb2.Policy] = {}
    if custom and proxyless:
        for policy in custom:  # gRPC has no ext_authz: fail closed
            problems.append(f"AuthorizationPolicy {policy.meta}: CUSTOM (provider {policy.provider!r}) is not "
                            "supported by proxyless gRPC; its rules deny")
        deny_extra = translate(Action.CUSTOM, strict=False)
    elif custom:
        names = custom_providers(custom)
        for name in names:
            mine = [p for p in custom if p.provider == name]
            resolved = providers.get(name)
            error = ("multiple CUSTOM authorization providers per workload are not supported "
                     f"(PILOT_ENABLE_MULTIPLE_CUSTOM_AUTHZ_PROVIDERS), found {list(names)}" if len(names) > 1
                     else "provider not resolved" if resolved is None else resolved.error)
            prefix = f"{EXT_AUTHZ_MATCH_PREFIX}-{name}-"
            rules = translate(Action.CUSTOM, strict=False, prefix=prefix, only=mine)
            if error:
                # As istiod: the provider's rules deny what they match.
                problems.append(f"CUSTOM provider {name!r} of AuthorizationPolicy "
                                f"{', '.join(str(p.meta) for p in mine)}: {error}; its rules deny")
                parts.append((rbac_pb2.RBAC(action=rbac_pb2.RBAC.DENY, policies={
                    k + "-deny-due-to-bad-CUSTOM-action": v for k, v in rules.items()}), None, None))
            else:
                assert resolved is not None
                parts.append((rbac_pb2.RBAC(), rbac_pb2.RBAC(action=rbac_pb2.RBAC.DENY, policies=rules), resolved))
    audit = [p for p in policies if p.action is Action.AUDIT]
    if audit and proxyless:  # as istiod's gRPC generator, which builds ALLOW and DENY only
        problems += [f"AuthorizationPolicy {p.meta}: AUDIT is not supported by proxyless gRPC; the policy has no "
                     "effect" for p in audit]
    elif audit and (logged := translate(Action.AUDIT, strict=False)):
        parts.append((rbac_pb2.RBAC(action=rbac_pb2.RBAC.LOG, policies=logged), None, None))
    if deny := {**translate(Action.DENY, strict=False), **deny_extra}:
        parts.append((rbac_pb2.RBAC(action=rbac_pb2.RBAC.DENY, policies=dict(sorted(deny.items()))), None, None))
    if any(p.action is Action.ALLOW for p in policies):
        # ALLOW policies whose rules match nothing (or none translated) deny every request
        parts.append((rbac_pb2.RBAC(action=rbac_pb2.RBAC.ALLOW, policies=translate(Action.ALLOW, strict=True)),
                      None, None))
    return _Built(tuple(parts), tuple(problems))
@dataclass(frozen=True, slots=True)
class _Translated:
    policy: rbac_pb2.Policy
    problems: tuple[str, ...]


class _Collector:
    """Unsupported fields raise (strict: ALLOW) or are noted and skipped (DENY); `for_tcp`: a TCP
    filter chain, where HTTP-only fields cannot be checked; `request_auth`: JWT fields can be;
    `proxyless`: gRPC's RBAC filter (gRFC A41), which has no path templates, no SNI and no
    dynamic metadata (envoy.filters.* keys)."""

    def __init__(self, strict: bool, namespace: str, for_tcp: bool = False, request_auth: bool = False,
                 proxyless: bool = False, peer_state: bool = False) -> None:
        self.strict = strict
        self.peer_state = peer_state  # the caller's identity from filter state (see authorization_filters)
        self.namespace = namespace  # the policy's: a service account without one is in it
        self.for_tcp = for_tcp
        self.request_auth = request_auth and not for_tcp
        self.proxyless = proxyless
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

    def envoy_only(self, what: str) -> bool:
        """True (after reporting it) when gRPC's RBAC filter cannot check `what`."""
        if self.proxyless:
            self.unsupported(what, "is not supported by proxyless gRPC")
        return self.proxyless


def _policy(rule: Rule, c: _Collector) -> _Translated:
    principals = [_source(s, c) for s in rule.sources]
    permissions = [_operation(o, c) for o in rule.operations]
    principal_ands = [_or_ids(principals)] if principals else []
    permission_ands = [_or_rules(permissions)] if permissions else []
    for condition in rule.when:
        _condition(condition, c, principal_ands, permission_ands)
    principal = _and_ids(principal_ands)
    return _Translated(
        rbac_pb2.Policy(principals=[_peer_from_state(principal) if c.peer_state else principal],
                        permissions=[_and_rules(permission_ands)]),
        tuple(c.problems),
    )


def _peer_from_state(principal: rbac_pb2.Principal) -> rbac_pb2.Principal:
    """The principal with the certificate's identity read from PEER_PRINCIPAL_STATE instead (istiod's
    principalAuthenticated for waypoints)."""
    kind = principal.WhichOneof("identifier")
    if kind == "authenticated":
        return rbac_pb2.Principal(filter_state=filter_state_pb2.FilterStateMatcher(
            key=PEER_PRINCIPAL_STATE, string_match=principal.authenticated.principal_name))
    if kind in ("and_ids", "or_ids"):
        members = [_peer_from_state(p) for p in getattr(principal, kind).ids]
        return rbac_pb2.Principal(**{kind: rbac_pb2.Principal.Set(ids=members)})
    if kind == "not_id":
        return rbac_pb2.Principal(not_id=_peer_from_state(principal.not_id))
    return principal


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
    field(source.service_accounts, False, partial(_service_account, c.namespace))
    field(source.not_service_accounts, True, partial(_service_account, c.namespace))
    field(source.trust_domains, False, _trust_domain)
    field(source.not_trust_domains, True, _trust_domain)
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
            if any(_is_template(p) for p in values) and c.envoy_only("to.operation.paths with a template ({*} or {**})"):
                values = tuple(p for p in values if not _is_template(p))
            field(values, negate, _path)
    if (operation.hosts or operation.not_hosts) and not c.http_only("to.operation.hosts"):
        field(operation.hosts, False, lambda h: rbac_pb2.Permission(header=_host(h)))
        field(operation.not_hosts, True, lambda h: rbac_pb2.Permission(header=_host(h)))
    return _and_rules(ands)


def _condition(condition: Condition, c: _Collector, principals: list[rbac_pb2.Principal],
               permissions: list[rbac_pb2.Permission]) -> None:
    key = condition.key
    principals_by_key: dict[str, Callable[[str], rbac_pb2.Principal]] = {
        "source.ip": lambda v: rbac_pb2.Principal(direct_remote_ip=_cidr(v)),
        "remote.ip": lambda v: rbac_pb2.Principal(remote_ip=_cidr(v)),
        "source.namespace": _namespace,
        "source.principal": _principal,
        "source.serviceAccount": partial(_service_account, c.namespace),
        "source.trustDomain": _trust_domain,
    }
    principal = principals_by_key.get(key)
    permission: Callable[[str], rbac_pb2.Permission] | None
    permission = {
        "destination.ip": lambda v: rbac_pb2.Permission(destination_ip=_cidr(v)),
        "destination.port": lambda v: rbac_pb2.Permission(destination_port=int(v)),
        "connection.sni": lambda v: rbac_pb2.Permission(requested_server_name=_string(v)),
    }.get(key)
    if key.startswith("request.") and c.http_only(f"when.key {key}"):
        return
    if (key == "connection.sni" or key.startswith(_ENVOY_FILTER)) and c.envoy_only(f"when.key {key}"):
        return
    if key.startswith(_ENVOY_FILTER):
        # All values in one metadata matcher, as istiod's envoyFilterGenerator.
        for values, negate in ((condition.values, False), (condition.not_values, True)):
            if values:
                matched_m = _envoy_filter_metadata(key, values)
                permissions.append(rbac_pb2.Permission(not_rule=matched_m) if negate else matched_m)
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


_ENVOY_FILTER = "experimental.envoy.filters."


def _envoy_filter_metadata(key: str, values: Sequence[str]) -> rbac_pb2.Permission:
    """`experimental.envoy.filters.<filter>[<key>]`: the filter's dynamic metadata under the key,
    one of the values (`[v]`: a list holding v)."""
    filter_name, _, field_key = key[len("experimental."):].removesuffix("]").partition("[")
    matchers = [
        value_pb2.ValueMatcher(list_match=value_pb2.ListMatcher(
            one_of=value_pb2.ValueMatcher(string_match=_string(v[1:-1]))))
        if v.startswith("[") and v.endswith("]") else value_pb2.ValueMatcher(string_match=_string(v))
        for v in values
    ]
    value = matchers[0] if len(matchers) == 1 else value_pb2.ValueMatcher(
        or_match=value_pb2.OrMatcher(value_matchers=matchers))
    return rbac_pb2.Permission(metadata=metadata_pb2.MetadataMatcher(
        filter=filter_name, path=[metadata_pb2.MetadataMatcher.PathSegment(key=field_key)], value=value))


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
    return lambda v: _jwt_claim(path, string_or_list(_string(v)))


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
    return rbac_pb2.Principal(metadata=payload_matcher(path, value))


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


def _trust_domain(value: str) -> rbac_pb2.Principal:
    """The trust domain of the peer's SPIFFE identity (istiod's: any, exact, or `*` at one end)."""
    if value == "*":
        matcher = string_pb2.StringMatcher(prefix=_SPIFFE)
    elif "*" not in value:
        matcher = string_pb2.StringMatcher(prefix=f"{_SPIFFE}{value}/")
    else:
        before, _, after = value.partition("*")
        matcher = string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(
            regex=f"{_re2_escape(_SPIFFE + before)}[^/]*{_re2_escape(after)}/.*"))
    return rbac_pb2.Principal(authenticated=rbac_pb2.Principal.Authenticated(principal_name=matcher))


def _namespace(value: str) -> rbac_pb2.Principal:
    body = _re2_escape(value.strip("*"))
    body = (".*" if value.startswith("*") else "") + body + (".*" if value.endswith("*") and value != "*" else "")
    if value == "*":
        body = ".+"
    matcher = string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=f".*/ns/{body}/.*"))
    return rbac_pb2.Principal(authenticated=rbac_pb2.Principal.Authenticated(principal_name=matcher))


def _service_account(namespace: str, value: str) -> rbac_pb2.Principal:
    """`sa` or `ns/sa`: any identity with that namespace and service account, as istiod's regex."""
    ns, found, sa = value.partition("/")
    if not found:
        ns, sa = namespace, value
    regex = f"spiffe://.+/ns/{_re2_escape(ns)}/(.+/|)sa/{_re2_escape(sa)}(/.+)?"
    matcher = string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=regex))
    return rbac_pb2.Principal(authenticated=rbac_pb2.Principal.Authenticated(principal_name=matcher))


def _is_template(path: str) -> bool:
    return "{*}" in path or "{**}" in path


def _path(value: str) -> rbac_pb2.Permission:
    if _is_template(value):
        # Envoy's uri_template matcher: `{*}` is one segment (`*`), `{**}` the rest (`**`).
        template = value.replace("{**}", "**").replace("{*}", "*")
        config = uri_template_match_pb2.UriTemplateMatchConfig(path_template=template)
        return rbac_pb2.Permission(uri_template=extension_pb2.TypedExtensionConfig(name="uri-template",
                                                                                   typed_config=pack(config)))
    return rbac_pb2.Permission(url_path=path_pb2.PathMatcher(path=_string(value)))


def _host(value: str) -> route_components_pb2.HeaderMatcher:
    """The `:authority` header, case-insensitively, as istiod's HostMatcher."""
    if value == "*":
        return route_components_pb2.HeaderMatcher(name=":authority", present_match=True)
    matcher = _string(value)
    matcher.ignore_case = True
    return route_components_pb2.HeaderMatcher(name=":authority", string_match=matcher)


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

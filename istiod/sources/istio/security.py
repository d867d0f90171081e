"""security.istio.io objects -> model values, validated as istiod validates them."""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import re
import urllib.parse

from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from istiod.durations import parse_duration
from istiod.model.config.security import (
    Action, AuthorizationPolicy, Condition, JWTHeader, JWTRule, MTLSMode, Operation, PeerAuthentication,
    RequestAuthentication, Rule, Source,
)
from istiod.sources.fields import ObjectKey, _Fields
from istiod.sources.istio.common import enum_field, fields, ip_or_cidr, items, meta, spec, only, str_list, workload_selector

_TARGET_REFS = ("targetRef", "targetRefs")  # Gateway API policy attachment: not implemented


def _mode(sub: _Fields | None) -> MTLSMode:
    if sub is None:
        return MTLSMode.UNSET
    only(sub, ("mode",))
    return enum_field(sub, "mode", MTLSMode, "UNSET")  # type: ignore[return-value]


def peer_authentication(key: ObjectKey, f: _Fields, domain: str) -> PeerAuthentication:
    spec(f, ("selector", "mtls", "portLevelMtls"), _TARGET_REFS)
    selector = workload_selector(f)
    port_level = []
    # YAML writes the ports as numbers or strings: `{8080: {mode: DISABLE}}`.
    for name, value in f.get("spec.portLevelMtls", dict, {}).items():
        where = f"spec.portLevelMtls.{name}"
        if not str(name).isdigit() or not 0 < int(name) < 65536:
            raise f.fail(f"spec.portLevelMtls: port {name!r} is not in 1-65535")
        if not isinstance(value, dict):
            raise f.fail(f"{where}: expected a map")
        port_level.append((int(name), _mode(_Fields(f"{f.key} {where}", value))))
    if port_level and not selector:
        raise f.fail("spec.portLevelMtls: mesh/namespace peer authentication cannot have port level mTLS")
    return PeerAuthentication(meta(key), selector, _mode(fields(f, "spec.mtls")), tuple(sorted(port_level)))


_SOURCE_FIELDS = ("principals", "notPrincipals", "requestPrincipals", "notRequestPrincipals", "namespaces",
                  "notNamespaces", "ipBlocks", "notIpBlocks", "remoteIpBlocks", "notRemoteIpBlocks", "serviceAccounts",
                  "notServiceAccounts", "trustDomains", "notTrustDomains")
# Source fields and `when` keys istiod refuses with action CUSTOM (an external authorizer sees no identities).
_CUSTOM_REFUSED = ("namespaces", "notNamespaces", "serviceAccounts", "notServiceAccounts", "principals",
                   "notPrincipals", "requestPrincipals", "notRequestPrincipals", "trustDomains", "notTrustDomains")
_CUSTOM_REFUSED_KEYS = ("source.namespace", "source.serviceAccount", "source.principal", "source.trustDomain")
_PATH_LITERAL = re.compile(r"^[a-zA-Z0-9-._~%!$&'()+,;:@=]+$")  # RFC 3986 pchar, as istiod checks templates
_OPERATION_FIELDS = ("hosts", "notHosts", "ports", "notPorts", "methods", "notMethods", "paths", "notPaths")
# Attributes a `when` condition may name (istiod's ValidateAttribute), by prefix for the bracketed ones.
_ATTRIBUTES = ("source.ip", "remote.ip", "source.namespace", "source.principal", "request.auth.principal",
               "request.auth.audiences", "request.auth.presenter", "destination.ip", "destination.port",
               "connection.sni", "source.serviceAccount", "source.trustDomain")
_ATTRIBUTE_PREFIXES = ("request.headers[", "request.auth.claims[", "experimental.envoy.filters.")


def _values(f: _Fields, path: str) -> tuple[str, ...]:
    values = str_list(f, path)
    if any(not v for v in values):
        raise f.fail(f"{path}: empty value is not allowed")
    return values


def _ports(f: _Fields, path: str) -> tuple[int, ...]:
    values = _values(f, path)
    for value in values:
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise f.fail(f"{path}: invalid port {value}")
    return tuple(int(v) for v in values)


def _source(f: _Fields, path: str, action: Action) -> Source:
    sub = fields(f, path)
    if sub is None:
        raise f.fail(f"{path} must not be nil")
    only(sub, _SOURCE_FIELDS)
    if not any(sub.body.get(k) for k in _SOURCE_FIELDS):
        raise f.fail(f"{path} must not be empty")
    for name in ("ipBlocks", "notIpBlocks", "remoteIpBlocks", "notRemoteIpBlocks"):
        for value in _values(sub, name):
            ip_or_cidr(f, f"{path}.{name}", value)
    if (any(sub.body.get(k) for k in ("principals", "notPrincipals", "namespaces", "notNamespaces"))
            and any(sub.body.get(k) for k in ("serviceAccounts", "notServiceAccounts"))):
        raise f.fail(f"{path}: cannot set serviceAccounts with namespaces or principals")
    for name in ("serviceAccounts", "notServiceAccounts"):
        _service_accounts(sub, name, _values(sub, name))
    for name in ("trustDomains", "notTrustDomains"):
        _trust_domains(sub, name, _values(sub, name))
    if action is Action.CUSTOM:
        for name in _CUSTOM_REFUSED:
            if sub.body.get(name):
                raise f.fail(f"{path}.{name} is currently not supported with CUSTOM action")
    return Source(*(_values(sub, name) for name in _SOURCE_FIELDS))


def _service_accounts(f: _Fields, path: str, values: tuple[str, ...]) -> None:
    """istiod's CheckServiceAccount: `sa` or `ns/sa`, no wildcard."""
    for value in values:
        if "*" in value:
            raise f.fail(f"{path}: {value!r}: wildcard not allowed")
        ns, found, sa = value.partition("/")
        if value.count("/") > 1 or not ns or (found and not sa):
            raise f.fail(f"{path}: expected format 'serviceAccount' or 'namespace/serviceAccount', found {value!r}")
        if len(value) > 320:
            raise f.fail(f"{path}: value cannot exceed 320 characters, found {value!r}")


def _wildcards(f: _Fields, path: str, values: tuple[str, ...]) -> None:
    """istiod's CheckWildcardValues: at most one `*`, at the start or the end."""
    for value in values:
        if value.count("*") > 1:
            raise f.fail(f"{path}: at most one wildcard is allowed, found {value!r}")
        if "*" in value and value != "*" and not value.startswith("*") and not value.endswith("*"):
            raise f.fail(f"{path}: wildcard is only allowed at the start or end, found {value!r}")


def _trust_domains(f: _Fields, path: str, values: tuple[str, ...]) -> None:
    """istiod's CheckTrustDomainValues."""
    _wildcards(f, path, values)
    for value in values:
        if "/" in value:
            raise f.fail(f"{path}: trust domain must not contain '/', found {value!r}")


def _path_template(f: _Fields, path: str, value: str) -> None:
    """istiod's CheckValidPathTemplate: `{*}` and `{**}` are whole segments, `{**}` only last."""
    template = "{*}" in value or "{**}" in value
    any_found = False
    for glob in value.strip("/").split("/"):
        if glob in ("{*}", "{**}"):
            if any_found:
                raise f.fail(f"{path}: invalid or unsupported path {value}: {{**}} is not the last operator")
            any_found = glob == "{**}"
            continue
        if "{" in glob or "}" in glob:
            raise f.fail(f"{path}: invalid or unsupported path {value}: contains '{{' or '}}' beyond a supported "
                         "path template")
        if template and not _PATH_LITERAL.match(glob):
            raise f.fail(f"{path}: invalid or unsupported path {value}: contains segment {glob!r} with invalid "
                         "string literal")


def _operation(f: _Fields, path: str) -> Operation:
    sub = fields(f, path)
    if sub is None:
        raise f.fail(f"{path} must not be nil")
    only(sub, _OPERATION_FIELDS)
    if not any(sub.body.get(k) for k in _OPERATION_FIELDS):
        raise f.fail(f"{path} must not be empty")
    for name in ("paths", "notPaths"):
        for value in _values(sub, name):
            _path_template(f, f"{path}.{name}", value)
            if "*" in value.strip("*") and "{" not in value:
                raise f.fail(f"{path}.{name}: {value!r}: '*' is allowed only as a prefix or a suffix")
    return Operation(_values(sub, "hosts"), _values(sub, "notHosts"), _ports(sub, "ports"), _ports(sub, "notPorts"),
                     _values(sub, "methods"), _values(sub, "notMethods"), _values(sub, "paths"),
                     _values(sub, "notPaths"))


def _condition(c: _Fields, action: Action) -> Condition:
    only(c, ("key", "values", "notValues"))
    key = c.get("key", str, "")
    if not key:
        raise c.fail("`key` must not be empty")
    values, not_values = _values(c, "values"), _values(c, "notValues")
    if not values and not not_values:
        raise c.fail(f"at least one of `values` or `notValues` must be set for key {key}")
    if key not in _ATTRIBUTES and not key.startswith(_ATTRIBUTE_PREFIXES):
        raise c.fail(f"key: unknown attribute: {key}")
    if key.startswith(_ATTRIBUTE_PREFIXES) and not re.fullmatch(r"[^\[]+\[.+\]", key):
        raise c.fail(f"key: bad key ({key}): should have format a[b]")
    if action is Action.CUSTOM and (key in _CUSTOM_REFUSED_KEYS or key.startswith("request.auth.")):
        raise c.fail(f"key: {key} is currently not supported with CUSTOM action")
    if key == "source.serviceAccount":
        _service_accounts(c, "values", values + not_values)
    if key == "source.trustDomain":
        _wildcards(c, "values", values + not_values)
    for value in values + not_values:
        if key in ("source.ip", "remote.ip", "destination.ip"):
            ip_or_cidr(c, "values", value)
        elif key == "destination.port" and not (value.isdigit() and 0 < int(value) < 65536):
            raise c.fail(f"invalid `value` for `key` {key}: invalid port {value}")
    return Condition(key, values, not_values)


def authorization_policy(key: ObjectKey, f: _Fields, domain: str) -> AuthorizationPolicy:
    spec(f, ("selector", "action", "rules", "provider", *_TARGET_REFS))
    target_refs = _target_refs(f, key.namespace)
    action: Action = enum_field(f, "spec.action", Action, "ALLOW")  # type: ignore[assignment]
    has_rules = "rules" in f.get("spec", dict, {})
    provider = ""
    if (p := fields(f, "spec.provider")) is not None:
        only(p, ("name",))
        provider = p.get("name", str, "")
    if action is Action.CUSTOM:
        if not has_rules:
            raise f.fail("spec.rules: CUSTOM action without `rules` is meaningless as it will never be triggered, "
                         "add an empty rule `{}` if you want it be triggered for every request")
        if not provider:
            raise f.fail("spec.provider.name must not be empty")
    elif p is not None:
        raise f.fail(f"spec.provider must not be with non CUSTOM action, found {action.value}")
    if action is Action.DENY and not f.get("spec.rules", list, []):
        raise f.fail("spec.rules: DENY action without `rules` is meaningless as it will never be triggered, "
                     "add an empty rule `{}` if you want it be triggered for every request")
    rules = []
    for i, r in enumerate(items(f, "spec.rules")):
        only(r, ("from", "to", "when"))
        where = f"spec.rules[{i}]"
        for part in ("from", "to"):
            if part in r.body and not r.get(part, list, []):
                raise f.fail(f"{where}.{part} must not be empty")
        for item in items(r, "from"):
            only(item, ("source",))
        for item in items(r, "to"):
            only(item, ("operation",))
        sources = tuple(_source(item, "source", action) for item in items(r, "from"))
        operations = tuple(_operation(item, "operation") for item in items(r, "to"))
        rules.append(Rule(sources, operations, tuple(_condition(c, action) for c in items(r, "when"))))
    if target_refs:
        _attachable(f, action, rules)
    return AuthorizationPolicy(meta(key), workload_selector(f), action, tuple(rules), provider, target_refs)


_TARGET_KINDS = {"Gateway": "gateway.networking.k8s.io", "Service": ""}


def _target_refs(f: _Fields, namespace: str) -> tuple[tuple[str, str], ...]:
    """istiod's rules: targetRef or targetRefs, not both and not with a selector; here kinds `Gateway`
    (a waypoint's) and `Service` (applied on the waypoint it uses), in the policy's own namespace."""
    body = f.get("spec", dict, {})
    if "targetRef" in body and "targetRefs" in body:
        raise f.fail("only one of targetRefs or workloadSelector can be set")
    refs = [fields(f, "spec.targetRef")] if "targetRef" in body else list(items(f, "spec.targetRefs"))
    if refs and "selector" in body:
        raise f.fail("only one of targetRefs or workloadSelector can be set")
    result = []
    for i, ref in enumerate(refs):
        where = "spec.targetRef" if "targetRef" in body else f"spec.targetRefs[{i}]"
        if ref is None:
            raise f.fail(f"{where} must not be nil")
        only(ref, ("group", "kind", "name", "namespace"))
        kind, name = ref.get("kind", str, ""), ref.get("name", str, "")
        if kind not in _TARGET_KINDS or ref.get("group", str, "") != _TARGET_KINDS[kind]:
            raise f.fail(f"{where}: group {ref.get('group', str, '')!r} kind {kind!r} is not implemented "
                         "(Gateway of gateway.networking.k8s.io, or Service of the core group)")
        if not name:
            raise f.fail(f"{where}.name must be set")
        if ref.get("namespace", str, namespace) != namespace:
            raise f.fail(f"{where}.namespace must be the policy's namespace ({namespace})")
        result.append((kind, name))
    return tuple(result)


_PEER_KEYS = ("source.principal", "source.namespace", "source.serviceAccount", "source.trustDomain")


def _attachable(f: _Fields, action: Action, rules: list[Rule]) -> None:
    """What a waypoint applies here: ALLOW and DENY on the request (operations, request headers, JWT
    claims and request principals, from RequestAuthentications attached to it) and on the caller's
    identity (principals, namespaces, service accounts, trust domains: the certificate its ztunnel
    presented, which the waypoint keeps for the listener behind HBONE). That listener sees no client
    address, so IP blocks would never match: refused, not ignored."""
    if action not in (Action.ALLOW, Action.DENY):
        raise f.fail(f"spec.action: {action.value} is not implemented with targetRefs (ALLOW or DENY)")
    for i, rule in enumerate(rules):
        for j, source in enumerate(rule.sources):
            for name in ("ip_blocks", "not_ip_blocks", "remote_ip_blocks", "not_remote_ip_blocks"):
                if getattr(source, name):
                    field = "".join(part.capitalize() if k else part for k, part in enumerate(name.split("_")))
                    raise f.fail(f"spec.rules[{i}].from[{j}].source.{field} is not implemented with targetRefs")
        for condition in rule.when:
            if not condition.key.startswith("request.") and condition.key not in _PEER_KEYS:
                raise f.fail(f"spec.rules[{i}].when: key {condition.key} is not implemented with targetRefs")


def _jwt_rule(r: _Fields) -> JWTRule:
    # istiod fetches the keys itself (a jwksUri, else through the issuer's OpenID discovery
    # document) and inlines them (istiod/jwks.py).
    only(r, ("issuer", "audiences", "jwks", "jwksUri", "timeout", "fromHeaders", "fromParams", "fromCookies",
             "outputPayloadToHeader", "forwardOriginalToken", "outputClaimToHeaders"))
    issuer = r.get("issuer", str, "")
    if not issuer:
        raise r.fail("issuer must be set")
    audiences = str_list(r, "audiences")
    if any(not a for a in audiences):
        raise r.fail("audiences: audience must be non-empty string")
    jwks, jwks_uri = r.get("jwks", str, ""), r.get("jwksUri", str, "")
    if jwks and (error := jwks_error(jwks)) is not None:
        raise r.fail(f"jwks: jwks parse error: {error}")
    if jwks_uri:
        uri = urllib.parse.urlsplit(jwks_uri)
        if uri.scheme not in ("http", "https"):
            raise r.fail(f"jwksUri: URI scheme {uri.scheme!r} is not supported")
        if not uri.hostname:
            raise r.fail(f"jwksUri: {jwks_uri!r} has no host")
        try:
            uri.port
        except ValueError:
            raise r.fail(f"jwksUri: {jwks_uri!r} has an invalid port") from None
    timeout = 5.0
    if "timeout" in r.body:
        try:
            timeout = parse_duration(r.get("timeout", str, ""))
        except argparse.ArgumentTypeError as error:
            raise r.fail(f"timeout: {error}") from None
        if timeout <= 0:
            raise r.fail("timeout: must be positive")
    headers = []
    for h in items(r, "fromHeaders"):
        only(h, ("name", "prefix"))
        if not h.get("name", str, ""):
            raise h.fail("location header name must be non-empty string")
        headers.append(JWTHeader(h.get("name", str, ""), h.get("prefix", str, "")))
    params, cookies = str_list(r, "fromParams"), str_list(r, "fromCookies")
    if any(not p for p in params + cookies):
        raise r.fail("fromParams/fromCookies: location must be non-empty string")
    claims = []
    for c in items(r, "outputClaimToHeaders"):
        only(c, ("header", "claim"))
        header, claim = c.get("header", str, ""), c.get("claim", str, "")
        if not header or not claim:
            raise c.fail("outputClaimToHeaders header and claim value must be non-empty string")
        claims.append((header, claim))
    return JWTRule(issuer, audiences, jwks, tuple(headers), params, cookies,
                   r.get("outputPayloadToHeader", str, ""), r.get("forwardOriginalToken", bool, False), tuple(claims),
                   jwks_uri, timeout)


_EC_CURVES: dict[str, ec.EllipticCurve] = {"P-256": ec.SECP256R1(), "P-384": ec.SECP384R1(), "P-521": ec.SECP521R1()}


def jwks_error(jwks: str) -> str | None:
    """Why Envoy would refuse this JSON Web Key Set (a NACK of the whole listener), if it would:
    it needs at least one key, and we ask that every key be a public key its JWT library reads."""
    try:
        keys = json.loads(jwks).get("keys")
    except (ValueError, AttributeError):
        keys = None
    if not isinstance(keys, list) or not keys:
        return "expected a JSON object with a non-empty `keys` list"
    for i, key in enumerate(keys):
        try:
            _public_key(key)
        except ValueError as error:
            return f"keys[{i}]: {error}"
    return None


def _public_key(key: object) -> None:
    """Raise ValueError unless `key` is a JWK of a kind Envoy verifies with (RSA, EC, oct, Ed25519)."""
    if not isinstance(key, dict):
        raise ValueError("expected a JSON object")

    def member(name: str) -> int:
        value = key.get(name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"`{name}` must be set")
        try:
            return int.from_bytes(base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_", validate=True))
        except binascii.Error:
            raise ValueError(f"`{name}` is not base64url") from None

    kty = key.get("kty")
    if kty == "RSA":
        rsa.RSAPublicNumbers(member("e"), member("n")).public_key()
    elif kty == "EC":
        curve = _EC_CURVES.get(str(key.get("crv")))
        if curve is None:
            raise ValueError(f"EC `crv` {key.get('crv')!r} is not one of {', '.join(_EC_CURVES)}")
        ec.EllipticCurvePublicNumbers(member("x"), member("y"), curve).public_key()
    elif kty == "oct":
        member("k")
    elif kty == "OKP" and key.get("crv") == "Ed25519":
        ed25519.Ed25519PublicKey.from_public_bytes(member("x").to_bytes(32))
    else:
        raise ValueError(f"`kty` {kty!r} is not RSA, EC, oct or OKP (Ed25519)")


def request_authentication(key: ObjectKey, f: _Fields, domain: str) -> RequestAuthentication:
    spec(f, ("selector", "jwtRules", *_TARGET_REFS))
    return RequestAuthentication(meta(key), workload_selector(f), tuple(_jwt_rule(r) for r in items(f, "spec.jwtRules")),
                                 _target_refs(f, key.namespace))

"""gateway.networking.k8s.io objects -> typed values (istiod/model/config/gateway_api.py).

What the API server's schema would refuse (wrong types, unknown enum values, a missing name) is a
ConversionError naming the field, and the object keeps its last good state. What is valid API but
not translated here (a filter type, an RE2 pattern Envoy refuses, rule fields such as retry) is
kept on the rule as an error: that rule answers 500 (one whose match Envoy would refuse is left out) and the route's status names the field, so the
rest of the route and the Gateway keep working.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from istiod.model.config.common import MatchKind, StringMatch, regex_problem
from istiod.model.config.gateway_api import (
    EXPERIMENTAL_GROUP, GROUP, IGNORE_POLICY_ATTACHMENT, KIND_NAMES, L4_ROUTE_KINDS, VERSIONS, BackendTLSPolicy, BackendTrafficPolicy, FrontendValidation, GatewayClass, KubernetesGateway, KubernetesHTTPRoute,
    Listener, ObjectRef, ParentRef, PathModifier, ReferenceGrant, RequestRedirect, RouteFilter, RouteMatch, RouteRule,
    URLRewrite,
)
from istiod.model.config.networking import CorsPolicy, HeaderOperations, Headers, Retries, RetryBudget
from istiod.model.labels import Selector
from istiod.sources.fields import ConversionError, ObjectKey, _Fields
from istiod.sources.istio.common import fields, items, label_selector, meta, str_list

# The Gateway API's Duration: Go's grammar restricted to h, m, s and ms, at most four parts.
_DURATION = re.compile(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")
_DURATION_PART = re.compile(r"([0-9]{1,5})(h|m|s|ms)")
_UNITS = {"h": timedelta(hours=1), "m": timedelta(minutes=1), "s": timedelta(seconds=1), "ms": timedelta(milliseconds=1)}
_REDIRECT_CODES = (301, 302, 303, 307, 308)
_RULE_FIELDS_NOT_IMPLEMENTED = ("sessionPersistence",)


def kind_name(kind: str, api_version: object) -> str:
    """The store's kind for an object: Istio's KubernetesGateway for this group's Gateway."""
    if isinstance(api_version, str) and api_version.rpartition("/")[0] == GROUP:
        return KIND_NAMES.get(kind, kind)
    return kind


def _check_version(key: ObjectKey, body: Mapping[str, Any]) -> None:
    api_version = body.get("apiVersion")
    if api_version is None:  # informers' list items may lack it; the informer knows the kind
        return
    group, _, version = str(api_version).rpartition("/")
    served = RESOURCES[key.kind]
    if group != served.group or version not in served.versions:
        raise ConversionError(f"{key}: apiVersion {api_version!r}: {served.group} serves {', '.join(served.versions)}")


def _generation(f: _Fields) -> int:
    return int(f.get("metadata.generation", int, 0))


def _spec(f: _Fields) -> _Fields:
    spec = fields(f, "spec")
    if spec is None:
        raise f.fail("spec is required")
    return spec


def _required(f: _Fields, path: str) -> str:
    value = f.get(path, str, "")
    if not value:
        raise f.fail(f"{path} is required")
    return str(value)


def duration(f: _Fields, path: str) -> timedelta | None:
    text = f.get(path, str, None)
    if text is None:
        return None
    if not _DURATION.match(text):
        raise f.fail(f"{path}: {text!r} is not a Gateway API duration (e.g. 10s, 1m30s, 500ms)")
    return sum((int(n) * _UNITS[u] for n, u in _DURATION_PART.findall(text)), timedelta())


def gateway_class(key: ObjectKey, f: _Fields, domain: str) -> GatewayClass:
    spec = _spec(f)
    return GatewayClass(meta(key), _required(spec, "controllerName"), _generation(f), f.str_map("metadata.labels"))


def _object_ref(f: _Fields, default_group: str, default_kind: str, backend: bool = False) -> ObjectRef:
    port = f.get("port", int, 0)
    if port and not 0 < port < 65536:
        raise f.fail(f"port {port} is not in 1-65535")
    weight = f.get("weight", int, 1)
    if not 0 <= weight <= 1000000:
        raise f.fail(f"weight {weight} is not in 0-1000000")
    return ObjectRef(f.get("group", str, default_group), f.get("kind", str, default_kind), _required(f, "name"),
                     f.get("namespace", str, ""), port if backend else 0, weight if backend else 1)


def _parameters_ref(ref: _Fields) -> ObjectRef:
    return ObjectRef(ref.get("group", str, ""), _required(ref, "kind"), _required(ref, "name"))


def _listener(f: _Fields) -> Listener:
    # Any protocol the schema allows (HBONE for waypoints, domain-prefixed ones): a class of ours
    # reports those it does not serve as UnsupportedProtocol.
    protocol = _required(f, "protocol")
    port = f.get("port", int, 0)
    if not 0 < port < 65536:
        raise f.fail(f"port {port!r} is not in 1-65535")
    tls = fields(f, "tls")
    mode = ""
    certificates: tuple[ObjectRef, ...] = ()
    options: tuple[tuple[str, str], ...] = ()
    if tls is not None:
        mode = tls.get("mode", str, "Terminate")
        if mode not in ("Terminate", "Passthrough"):
            raise tls.fail(f"mode {mode!r} is not Terminate or Passthrough")
        certificates = tuple(_object_ref(ref, "", "Secret") for ref in items(tls, "certificateRefs"))
        options = tls.str_map("options")
    allowed = fields(f, "allowedRoutes")
    from_namespaces = "Same"
    selector = Selector()
    kinds: tuple[tuple[str, str], ...] = ()
    if allowed is not None:
        from_namespaces = allowed.get("namespaces.from", str, "Same")
        if from_namespaces not in ("Same", "All", "Selector"):
            raise allowed.fail(f"namespaces.from {from_namespaces!r} is not Same, All or Selector")
        if (namespaces := fields(allowed, "namespaces")) is not None and \
                (selected := fields(namespaces, "selector")) is not None:
            selector = label_selector(selected)
        elif from_namespaces == "Selector":
            raise allowed.fail("namespaces.selector is required with from: Selector")
        kinds = tuple((k.get("group", str, GROUP), _required(k, "kind")) for k in items(allowed, "kinds"))
    return Listener(_required(f, "name"), port, protocol, f.get("hostname", str, ""), mode, certificates, options,
                    from_namespaces, selector, kinds)


def gateway(key: ObjectKey, f: _Fields, domain: str) -> KubernetesGateway:
    spec = _spec(f)
    listeners = tuple(_listener(listener) for listener in items(spec, "listeners"))
    if not listeners:
        raise spec.fail("listeners: at least one listener is required")
    names = [listener.name for listener in listeners]
    if len(set(names)) != len(names):
        raise spec.fail("listeners: names must be unique")
    addresses = tuple((a.get("type", str, "IPAddress"), _required(a, "value")) for a in items(spec, "addresses"))
    # spec.infrastructure's labels and annotations go on the deployment (read from the stored
    # object by istiod/status/gateway_deployment.py); its parametersRef names the ConfigMap of overlays.
    ref = spec.get("infrastructure.parametersRef", dict, None)
    parameters = None if ref is None else _parameters_ref(_Fields(f"{spec.key} infrastructure.parametersRef", ref))
    default, per_port = _frontend(spec)
    annotations = dict(f.str_map("metadata.annotations"))
    return KubernetesGateway(meta(key), _required(spec, "gatewayClassName"), listeners, addresses, _generation(f),
                             parameters_ref=parameters, labels=f.str_map("metadata.labels"),
                             frontend_default=default, frontend_per_port=per_port,
                             name_override=annotations.get("gateway.istio.io/name-override", ""),
                             service_account=annotations.get("gateway.istio.io/service-account", ""))


def _frontend(spec: _Fields) -> tuple[FrontendValidation | None, tuple[tuple[int, FrontendValidation | None], ...]]:
    """spec.tls.frontend: client certificate validation, by default and per port. spec.tls.backend
    (the gateway's client certificate to backends) is not implemented: refused naming it."""
    tls = fields(spec, "tls")
    if tls is None:
        return None, ()
    if tls.get("backend", dict, None) is not None:
        raise tls.fail("backend is not implemented by this istiod")
    frontend = fields(tls, "frontend")
    if frontend is None:
        return None, ()
    default = fields(frontend, "default")
    if default is None:
        raise frontend.fail("default is required")
    per_port: list[tuple[int, FrontendValidation | None]] = []
    for entry in items(frontend, "perPort"):
        port = entry.get("port", int, 0)
        if not 0 < port < 65536:
            raise entry.fail(f"port {port!r} is not in 1-65535")
        if any(p == port for p, _ in per_port):
            raise entry.fail(f"port {port} appears twice in perPort")
        config = fields(entry, "tls")
        if config is None:
            raise entry.fail("tls is required")
        per_port.append((port, _validation(config)))
    return _validation(default), tuple(per_port)


def _validation(config: _Fields) -> FrontendValidation | None:
    validation = fields(config, "validation")
    if validation is None:
        return None
    mode = validation.get("mode", str, "AllowValidOnly")
    if mode not in ("AllowValidOnly", "AllowInsecureFallback"):
        raise validation.fail(f"mode {mode!r} is not AllowValidOnly or AllowInsecureFallback")
    refs = tuple(_object_ref(ref, "", "") for ref in items(validation, "caCertificateRefs"))
    if not refs:
        raise validation.fail("caCertificateRefs: at least one reference is required")
    return FrontendValidation(refs, mode)


def _parent_refs(spec: _Fields) -> tuple[ParentRef, ...]:
    refs = []
    for ref in items(spec, "parentRefs"):
        port = ref.get("port", int, 0)
        refs.append(ParentRef(_required(ref, "name"), ref.get("namespace", str, ""), ref.get("group", str, GROUP),
                              ref.get("kind", str, "Gateway"), ref.get("sectionName", str, ""), port))
    return tuple(refs)


def _match_value(f: _Fields, path: str, kinds: Mapping[str, MatchKind], default: str,
                 errors: list[tuple[str, str]]) -> StringMatch:
    kind_name_ = f.get("type", str, default)
    kind = kinds.get(kind_name_)
    if kind is None:
        raise f.fail(f"type {kind_name_!r} is not one of {', '.join(kinds)}")
    value = f.get("value", str, "/" if path == "path" else None)
    if value is None:
        raise f.fail("value is required")
    if kind is MatchKind.REGEX:
        problem = regex_problem(value)
        if problem:
            errors.append(("UnsupportedValue", f"{f.key}: {problem}"))
    elif path == "path" and not value.startswith("/"):
        raise f.fail(f"value {value!r} must be an absolute path (start with /)")
    return StringMatch(kind, value)


_PATH_KINDS = {"PathPrefix": MatchKind.PREFIX, "Exact": MatchKind.EXACT, "RegularExpression": MatchKind.REGEX}
_VALUE_KINDS = {"Exact": MatchKind.EXACT, "RegularExpression": MatchKind.REGEX}


def _named_matches(f: _Fields, path: str, errors: list[tuple[str, str]]) -> tuple[tuple[str, StringMatch], ...]:
    result: dict[str, StringMatch] = {}
    for item in items(f, path):
        name = _required(item, "name")
        # The spec: of two matches with one name, the first counts (header names ignore case).
        result.setdefault(name.lower() if path == "headers" else name, _match_value(item, "value", _VALUE_KINDS,
                                                                                    "Exact", errors))
    return tuple(result.items())


def _match(f: _Fields, errors: list[tuple[str, str]]) -> RouteMatch:
    path = fields(f, "path")
    return RouteMatch(
        path=_match_value(path, "path", _PATH_KINDS, "PathPrefix", errors) if path is not None else None,
        headers=_named_matches(f, "headers", errors),
        query_params=_named_matches(f, "queryParams", errors),
        method=f.get("method", str, ""),
    )


def _header_operations(f: _Fields) -> HeaderOperations:
    def pairs(path: str) -> tuple[tuple[str, str], ...]:
        return tuple((_required(h, "name"), h.get("value", str, "")) for h in items(f, path))
    return HeaderOperations(set=pairs("set"), add=pairs("add"), remove=str_list(f, "remove"))


def _path_modifier(f: _Fields | None) -> PathModifier | None:
    if f is None:
        return None
    kind = _required(f, "type")
    if kind == "ReplaceFullPath":
        return PathModifier(kind, f.get("replaceFullPath", str, "/"))
    if kind == "ReplacePrefixMatch":
        return PathModifier(kind, f.get("replacePrefixMatch", str, "/"))
    raise f.fail(f"type {kind!r} is not ReplaceFullPath or ReplacePrefixMatch")


def _filter(f: _Fields, errors: list[tuple[str, str]]) -> RouteFilter:
    kind = _required(f, "type")
    if kind == "RequestHeaderModifier":
        return RouteFilter(kind, request_headers=_header_operations(fields(f, "requestHeaderModifier") or f))
    if kind == "ResponseHeaderModifier":
        return RouteFilter(kind, response_headers=_header_operations(fields(f, "responseHeaderModifier") or f))
    if kind == "RequestRedirect":
        sub = fields(f, "requestRedirect") or _Fields(f.key, {})
        code = sub.get("statusCode", int, 302)
        if code not in _REDIRECT_CODES:
            raise sub.fail(f"statusCode {code} is not one of {_REDIRECT_CODES}")
        path = _path_modifier(fields(sub, "path"))
        return RouteFilter(kind, redirect=RequestRedirect(sub.get("scheme", str, ""), sub.get("hostname", str, ""),
                                                          path, sub.get("port", int, 0), code))
    if kind == "URLRewrite":
        sub = fields(f, "urlRewrite") or _Fields(f.key, {})
        return RouteFilter(kind, rewrite=URLRewrite(sub.get("hostname", str, ""), _path_modifier(fields(sub, "path"))))
    if kind == "RequestMirror":
        mirror = fields(f, "requestMirror")
        mirrored = fields(mirror, "backendRef") if mirror is not None else None
        if mirrored is None:
            raise f.fail("requestMirror.backendRef is required with type RequestMirror")
        return RouteFilter(kind, mirror=_object_ref(mirrored, "", "Service", backend=True))
    if kind == "CORS":
        return RouteFilter(kind, cors=_cors(fields(f, "cors") or _Fields(f.key, {})))
    errors.append(("InvalidFilter", f"{f.key}: filter type {kind!r} is not implemented by this istiod"))
    return RouteFilter(kind)


def _cors(f: _Fields) -> CorsPolicy:
    """istiod's createCorsFilter: `*` any well-formed origin, a trailing `*` a prefix, other wildcards a
    regex; preflights that match no origin are answered by the proxy (IGNORE)."""
    origins = []
    for origin in str_list(f, "allowOrigins"):
        if origin == "*":
            origins.append(StringMatch(MatchKind.REGEX, r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s?#]+$"))
        elif "*" not in origin:
            origins.append(StringMatch(MatchKind.EXACT, origin))
        elif origin.count("*") == 1 and origin.endswith("*"):
            origins.append(StringMatch(MatchKind.PREFIX, origin[:-1]))
        elif origin:
            origins.append(StringMatch(MatchKind.REGEX, "^" + re.escape(origin).replace(r"\*", ".*") + "$"))
    max_age = f.get("maxAge", int, 0)
    return CorsPolicy(tuple(origins), str_list(f, "allowMethods"), str_list(f, "allowHeaders"),
                      str_list(f, "exposeHeaders"), timedelta(seconds=max_age) if max_age > 0 else None,
                      True if f.get("allowCredentials", bool, False) else None, "IGNORE")


def _retry(f: _Fields | None) -> Retries | None:
    """istiod's: on connection errors and the listed codes, `attempts` times (2 by default)."""
    if f is None:
        return None
    attempts = f.get("attempts", int, 2)
    codes = f.get("codes", list, [])
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in codes):
        raise f.fail("codes: expected a list of HTTP status codes")
    retry_on = ("connect-failure", "refused-stream", "unavailable", "cancelled", *map(str, codes)) if attempts else ()
    return Retries(attempts, retry_on=retry_on, backoff=duration(f, "backoff"))


def _backend_headers(ref: _Fields, errors: list[tuple[str, str]]) -> Headers:
    """A backendRef's own filters: header modifiers, as istiod takes them (its other types refused)."""
    request, response = HeaderOperations(), HeaderOperations()
    for f in items(ref, "filters"):
        kind = _required(f, "type")
        if kind == "RequestHeaderModifier":
            request = _header_operations(fields(f, "requestHeaderModifier") or f)
        elif kind == "ResponseHeaderModifier":
            response = _header_operations(fields(f, "responseHeaderModifier") or f)
        else:
            errors.append(("InvalidFilter", f"{f.key}: unsupported filter type {kind!r}"))
    return Headers(request, response)


def _rule(f: _Fields) -> RouteRule:
    errors: list[tuple[str, str]] = []
    matches = tuple(_match(m, errors) for m in items(f, "matches"))
    unmatchable = bool(errors)  # only a match's pattern is an error this early
    filters = tuple(_filter(x, errors) for x in items(f, "filters"))
    backends = []
    for ref in items(f, "backendRefs"):
        backends.append(dataclasses.replace(_object_ref(ref, "", "Service", backend=True),
                                            headers=_backend_headers(ref, errors)))
    for name in _RULE_FIELDS_NOT_IMPLEMENTED:
        if f.body.get(name) is not None:
            errors.append(("UnsupportedValue", f"{f.key}.{name}: not implemented by this istiod"))
    timeouts = fields(f, "timeouts")
    return RouteRule(matches, filters, tuple(backends),
                     duration(timeouts, "request") if timeouts else None,
                     duration(timeouts, "backendRequest") if timeouts else None, _retry(fields(f, "retry")),
                     tuple(errors), unmatchable)


def http_route(key: ObjectKey, f: _Fields, domain: str) -> KubernetesHTTPRoute:
    spec = _spec(f)
    return KubernetesHTTPRoute(meta(key), _parent_refs(spec), str_list(spec, "hostnames"),
                               tuple(_rule(rule) for rule in items(spec, "rules")),
                               f.get("metadata.creationTimestamp", str, ""), _generation(f))


def _grpc_method(f: _Fields, errors: list[tuple[str, str]]) -> StringMatch | None:
    """A gRPC method match as the path `/<service>/<method>`, as istiod's createGRPCURIMatch."""
    method = fields(f, "method")
    if method is None:
        return None
    kind = method.get("type", str, "Exact")
    service, name = method.get("service", str, ""), method.get("method", str, "")
    if not service and not name:
        raise method.fail("service or method is required")
    if kind == "Exact":
        if not name:
            return StringMatch(MatchKind.PREFIX, f"/{service}/")
        if not service:
            return StringMatch(MatchKind.REGEX, f"/[^/]+/{name}")
        return StringMatch(MatchKind.EXACT, f"/{service}/{name}")
    if kind != "RegularExpression":
        raise method.fail(f"type {kind!r} is not Exact or RegularExpression")
    pattern = f"/{service or '[^/]+'}/{name or '.+'}"
    problem = regex_problem(pattern)
    if problem:
        errors.append(("UnsupportedValue", f"{method.key}: {problem}"))
    return StringMatch(MatchKind.REGEX, pattern)


def _grpc_rule(f: _Fields) -> RouteRule:
    errors: list[tuple[str, str]] = []
    matches = tuple(RouteMatch(path=_grpc_method(m, errors), headers=_named_matches(m, "headers", errors))
                    for m in items(f, "matches"))
    unmatchable = bool(errors)
    filters = []
    for x in items(f, "filters"):
        kind = _required(x, "type")
        if kind in ("RequestHeaderModifier", "ResponseHeaderModifier", "RequestMirror"):
            filters.append(_filter(x, errors))
        else:
            errors.append(("InvalidFilter", f"{x.key}: filter type {kind!r} is not implemented by this istiod"))
    backends = []
    for ref in items(f, "backendRefs"):
        backends.append(dataclasses.replace(_object_ref(ref, "", "Service", backend=True),
                                            headers=_backend_headers(ref, errors)))
    if f.body.get("sessionPersistence") is not None:
        errors.append(("UnsupportedValue", f"{f.key}.sessionPersistence: not implemented by this istiod"))
    return RouteRule(matches, tuple(filters), tuple(backends), errors=tuple(errors), unmatchable=unmatchable)


def grpc_route(key: ObjectKey, f: _Fields, domain: str) -> KubernetesHTTPRoute:
    """A GRPCRoute as the HTTP route it is on the wire (gRPC methods are paths), as istiod converts it."""
    spec = _spec(f)
    return KubernetesHTTPRoute(meta(key), _parent_refs(spec), str_list(spec, "hostnames"),
                               tuple(_grpc_rule(rule) for rule in items(spec, "rules")),
                               f.get("metadata.creationTimestamp", str, ""), _generation(f), kind="GRPCRoute")


def l4_route(key: ObjectKey, f: _Fields, domain: str) -> KubernetesHTTPRoute:
    """A TLSRoute (hostnames: SNI names) or TCPRoute: rules of backendRefs only."""
    spec = _spec(f)
    rules = []
    for rule in items(spec, "rules"):
        rules.append(RouteRule(backend_refs=tuple(_object_ref(ref, "", "Service", backend=True)
                                                  for ref in items(rule, "backendRefs"))))
    return KubernetesHTTPRoute(meta(key), _parent_refs(spec), str_list(spec, "hostnames") if key.kind == "TLSRoute" else (),
                               tuple(rules), f.get("metadata.creationTimestamp", str, ""), _generation(f), key.kind)


def reference_grant(key: ObjectKey, f: _Fields, domain: str) -> ReferenceGrant:
    spec = _spec(f)
    from_ = tuple((x.get("group", str, ""), _required(x, "kind"), _required(x, "namespace"))
                  for x in items(spec, "from"))
    to = tuple(ObjectRef(t.get("group", str, ""), _required(t, "kind"), t.get("name", str, ""))
               for t in items(spec, "to"))
    return ReferenceGrant(meta(key), from_, to)


def backend_tls_policy(key: ObjectKey, f: _Fields, domain: str) -> BackendTLSPolicy:
    spec = _spec(f)
    targets = tuple(ParentRef(_required(t, "name"), "", t.get("group", str, ""), _required(t, "kind"),
                              t.get("sectionName", str, "")) for t in items(spec, "targetRefs"))
    if not targets:
        raise spec.fail("targetRefs: at least one target is required")
    validation = spec.get("validation", dict, None)
    if validation is None:
        raise spec.fail("validation: required")
    v = _Fields(f"{spec.key} validation", validation)
    ca_refs = tuple(ObjectRef(r.get("group", str, ""), _required(r, "kind"), _required(r, "name"))
                    for r in items(v, "caCertificateRefs"))
    names = []
    for alt in items(v, "subjectAltNames"):
        kind = _required(alt, "type")
        if kind not in ("Hostname", "URI"):
            raise alt.fail(f"type {kind!r} is not one of Hostname, URI")
        names.append(_required(alt, "hostname" if kind == "Hostname" else "uri"))
    return BackendTLSPolicy(meta(key), targets, ca_refs, v.get("wellKnownCACertificates", str, ""),
                            _required(v, "hostname"), tuple(names), _generation(f),
                            f.get("metadata.creationTimestamp", str, ""), _ignored(f))


_BUDGET_INTERVAL = timedelta(seconds=10)  # the Gateway API's defaults, which istiod applies too
_MIN_RETRY_CONCURRENCY = 10


def backend_traffic_policy(key: ObjectKey, f: _Fields, domain: str) -> BackendTrafficPolicy:
    """XBackendTrafficPolicy: its retryConstraint with the Gateway API's defaults as istiod applies
    them (an interval of 10 s, at least 10 retries at once; the percent, unset, Envoy's 20)."""
    spec = _spec(f)
    targets = tuple(ParentRef(_required(t, "name"), "", t.get("group", str, ""), _required(t, "kind"))
                    for t in items(spec, "targetRefs"))
    if not targets:
        raise spec.fail("targetRefs: at least one target is required")
    budget = None
    if (constraint := fields(spec, "retryConstraint")) is not None:
        percent = constraint.get("budget.percent", int, None)
        if percent is not None and not 0 <= percent <= 100:
            raise constraint.fail(f"budget.percent: {percent} is not in range 0..100")
        count = constraint.get("minRetryRate.count", int, None)
        budget = RetryBudget(None if percent is None else float(percent), count or _MIN_RETRY_CONCURRENCY,
                             duration(constraint, "budget.interval") or _BUDGET_INTERVAL)
    unsupported = ("sessionPersistence",) if spec.get("sessionPersistence", dict, None) is not None else ()
    return BackendTrafficPolicy(meta(key), targets, budget, unsupported, _generation(f),
                                f.get("metadata.creationTimestamp", str, ""), _ignored(f))


def _ignored(f: _Fields) -> bool:
    """istiod's istio.io/ignore-policy-attachment: "true" (any case) leaves a policy to others."""
    return dict(f.str_map("metadata.annotations")).get(IGNORE_POLICY_ATTACHMENT, "").lower() == "true"


CONVERTERS: dict[str, Callable[[ObjectKey, _Fields, str], Any]] = {
    "GatewayClass": gateway_class,
    "KubernetesGateway": gateway,
    "HTTPRoute": http_route,
    "GRPCRoute": grpc_route,
    "ReferenceGrant": reference_grant,
    "BackendTLSPolicy": backend_tls_policy,
    "XBackendTrafficPolicy": backend_traffic_policy,
    **{kind: l4_route for kind in L4_ROUTE_KINDS},
}
CLUSTER_SCOPED = frozenset({"GatewayClass"})


@dataclasses.dataclass(frozen=True, slots=True)
class Resource:
    """Where the API serves a kind: for informers, RBAC and the status writer."""

    group: str
    version: str  # the one read and written
    plural: str
    versions: tuple[str, ...]  # every version an object may be written at


def _standard(plural: str) -> Resource:
    return Resource(GROUP, "v1", plural, VERSIONS)


RESOURCES = {"GatewayClass": _standard("gatewayclasses"), "KubernetesGateway": _standard("gateways"),
             "HTTPRoute": _standard("httproutes"), "GRPCRoute": _standard("grpcroutes"),
             "TCPRoute": _standard("tcproutes"), "TLSRoute": _standard("tlsroutes"),
             "ReferenceGrant": _standard("referencegrants"), "BackendTLSPolicy": _standard("backendtlspolicies"),
             "XBackendTrafficPolicy": Resource(EXPERIMENTAL_GROUP, "v1alpha1", "xbackendtrafficpolicies", ("v1alpha1",))}


def gateway_api_converter(key: ObjectKey, body: Mapping[str, Any]) -> Callable[[ObjectKey, _Fields, str], Any] | None:
    converter = CONVERTERS.get(key.kind)
    if converter is not None:
        _check_version(key, body)
    return converter

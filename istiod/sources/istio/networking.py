"""networking.istio.io objects -> model values, validated as istiod validates them."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import math
import re
from datetime import timedelta

from istiod.model.config.common import Labels, MatchKind, Meta, StringMatch
from istiod.model.config.scope import host_matches
from istiod.model.config.networking import (
    HEALTH_CHECKS_ANNOTATION, MESH_GATEWAY, ClientTLS, ConnectionPool, ConsistentHash, CorsPolicy, Destination, DestinationRule, DirectResponse,
    EgressListener, Fault, FaultAbort, FaultDelay, Gateway, HeaderOperations, Headers, HTTPMatch, HTTPRoute,
    HashAlgorithm, HTTPCookie, HTTPSettings, H2UpgradePolicy, IngressListener, L4Match, L4Route, LoadBalancer, LoadBalancerSettings, LocalityDistribute, LocalityFailover,
    LocalityLbSetting, Location, Mirror, OutlierDetection,
    PortTrafficPolicy, Redirect, Resolution, Retries, RetryBudget, Rewrite, RouteDestination, Server, ServerTLS, ServerTLSMode,
    ServiceEntry, ServicePort, Sidecar, Subset, TCPSettings, TcpKeepalive, TLSMode, TrafficPolicy, TunnelSettings,
    VirtualService, Warmup,
    WorkloadEntry,
    WorkloadGroup,
)
from istiod.model.config.networking import TLS_PROTOCOL_VERSIONS, routing_claim
from istiod.model.probe import ProbeError, parse_readiness_probe
from istiod.model.protocol import Protocol, parse as parse_protocol
from istiod.sources.fields import ObjectKey, _Fields
from istiod.sources.istio.common import (
    dns1123_label, duration, enum_field, export_to, fields, items, meta, spec, fqdn_error, integer, ip_or_cidr, is_ip, labels, only, percentage,
    port, protocol, raise_if, regex, resolve_host, str_keyed, str_list, string_match, string_match_list, string_matches, wildcard_domain_error,
    workload_selector,
)

log = logging.getLogger(__name__)

# Envoy's retry_on conditions and gRPC codes istiod accepts in retries.retryOn (plus HTTP status numbers).
RETRY_ON = frozenset({
    "5xx", "gateway-error", "reset", "reset-before-request", "connect-failure", "envoy-ratelimited", "retriable-4xx",
    "refused-stream", "retriable-status-codes", "retriable-headers", "http3-post-connect-failure",
    "cancelled", "deadline-exceeded", "internal", "resource-exhausted", "unavailable",
})
GRPC_CODES = frozenset({
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
    "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
})


# --- VirtualService ---------------------------------------------------------------------------

def _gateway_ref(f: _Fields, path: str, name: str, namespace: str) -> str:
    """`mesh`, `<ns>/<name>`, a bare name (in the object's namespace), or the legacy FQDN form."""
    if name == MESH_GATEWAY:
        return name
    ns, slash, gw = name.partition("/")
    if slash:
        if not (dns1123_label(ns) and dns1123_label(gw)):
            raise f.fail(f"{path}: invalid gateway name {name!r}")
        return name
    if dns1123_label(name):
        return f"{namespace}/{name}"
    parts = name.split(".")
    if len(parts) >= 2 and all(dns1123_label(p) for p in parts[:2]) and fqdn_error(name) is None:
        return f"{parts[1]}/{parts[0]}"  # name.namespace.svc.cluster.local
    raise f.fail(f"{path}: invalid gateway name {name!r}")


def _gateway_refs(f: _Fields, path: str, namespace: str) -> tuple[str, ...]:
    return tuple(_gateway_ref(f, f"{path}[{i}]", g, namespace) for i, g in enumerate(str_list(f, path)))


def _destination(f: _Fields, path: str, namespace: str, domain: str) -> Destination:
    sub = fields(f, path)
    if sub is None:
        raise f.fail(f"{path} is required")
    only(sub, ("host", "subset", "port"))
    host = sub.get("host", str, "")
    if not host:
        raise f.fail(f"{path}.host is required")
    if host == "*":
        raise f.fail(f"{path}.host: invalid destination host {host}")
    raise_if(f, wildcard_domain_error(host), f"{path}.host")
    subset = sub.get("subset", str, "")
    if subset and not dns1123_label(subset):
        raise f.fail(f"{path}.subset: subset name is invalid: {subset}")
    number = 0
    port_fields = fields(sub, "port")
    if port_fields is not None:
        only(port_fields, ("number",))
        number = port(f, f"{path}.port.number") or 0
    return Destination(resolve_host(host, namespace, domain), subset, number)


# istiod's validateHeaderValue (Envoy's header formatter syntax), or Envoy NACKs the routes.
_HEADER_VALUE = re.compile(r"(?:[^%]|%%|%(?:[^%(]+|[^%(]*\([^)]*\) *)%)*")


def _header_operations(f: _Fields, path: str) -> HeaderOperations:
    sub = fields(f, path)
    if sub is None:
        return HeaderOperations()
    only(sub, ("set", "add", "remove"))
    request = path.endswith("request")
    for op in ("set", "add"):
        for name, value in sub.str_map(op):
            # A request may set the authority (`:authority` or `host`); no other pseudo-header.
            authority = name.lower() in (":authority", "host")
            if not name or (name.startswith(":") or authority) and not (request and authority):
                raise f.fail(f"{path}.{op}: invalid header name {name!r}")
            if not _HEADER_VALUE.fullmatch(value):
                raise f.fail(f"{path}.{op}.{name}: invalid header value {value!r}: a % starts an Envoy "
                             "%VARIABLE% or %VARIABLE(args)%, %% is a literal %")
    removed = str_list(sub, "remove")
    for name in removed:
        if not name or name.startswith(":") or name.lower() == "host":
            raise f.fail(f"{path}.remove: invalid header name {name!r}")
    return HeaderOperations(sub.str_map("set"), sub.str_map("add"), removed)


def _headers(f: _Fields, path: str) -> Headers:
    sub = fields(f, path)
    if sub is None:
        return Headers()
    only(sub, ("request", "response"))
    return Headers(_header_operations(f, f"{path}.request"), _header_operations(f, f"{path}.response"))


def _route_destinations(f: _Fields, path: str, namespace: str, domain: str) -> tuple[RouteDestination, ...]:
    result = []
    for i, item in enumerate(items(f, path)):
        only(item, ("destination", "weight", "headers"))
        weight = integer(item, "weight", 0)
        result.append(RouteDestination(_destination(item, "destination", namespace, domain), weight or 0,
                                       _headers(item, "headers")))
    if len(result) > 1 and sum(r.weight for r in result) == 0:
        raise f.fail(f"{path}: total destination weight = 0")
    return tuple(result)


def _source_namespace(f: _Fields) -> str:
    value = f.get("sourceNamespace", str, "")
    if value and not dns1123_label(value):
        raise f.fail(f"sourceNamespace match {value} is invalid")
    return value


_HEADER_NAME = re.compile(r"[-_A-Za-z0-9]+")  # istiod's rule for header match names


def _header_matches(m: _Fields, path: str) -> tuple[tuple[str, StringMatch], ...]:
    matches = string_matches(m, path)
    for name, _ in matches:
        if not _HEADER_NAME.fullmatch(name) and routing_claim(name) is None:
            raise m.fail(f"{path}: header name {name!r} is not a valid header name")
    return matches


def _http_match(m: _Fields, namespace: str, domain: str) -> HTTPMatch:
    only(m, ("name", "uri", "scheme", "method", "authority", "headers", "withoutHeaders", "queryParams", "port",
             "sourceLabels", "gateways", "sourceNamespace", "ignoreUriCase", "statPrefix"))
    return HTTPMatch(
        name=m.get("name", str, ""),
        uri=string_match(m, "uri"),
        scheme=string_match(m, "scheme"),
        method=string_match(m, "method"),
        authority=string_match(m, "authority"),
        headers=_header_matches(m, "headers"),
        without_headers=_header_matches(m, "withoutHeaders"),
        query_params=string_matches(m, "queryParams"),
        port=port(m, "port") or 0,
        source_labels=labels(m, "sourceLabels"),
        gateways=_gateway_refs(m, "gateways", namespace),
        source_namespace=_source_namespace(m),
        ignore_uri_case=m.get("ignoreUriCase", bool, False),
        stat_prefix=m.get("statPrefix", str, ""),
    )


def _fault(f: _Fields, path: str) -> Fault | None:
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("delay", "abort"))
    delay = abort = None
    if (d := fields(sub, "delay")) is not None:
        only(d, ("fixedDelay", "percentage", "percent", "exponentialDelay"))
        if "exponentialDelay" in d.body:  # istiod's validation refuses it so
            raise f.fail(f"{path}.delay.exponentialDelay: exponentialDelay not supported yet")
        fixed = duration(d, "fixedDelay")
        if fixed is None:
            raise f.fail(f"{path}.delay.fixedDelay is required")
        delay = FaultDelay(fixed, _percent(d))
    if (a := fields(sub, "abort")) is not None:
        only(a, ("httpStatus", "grpcStatus", "percentage", "http2Error"))
        if "http2Error" in a.body:  # istiod's validation refuses it so
            raise f.fail(f"{path}.abort.http2Error: HTTP/2 abort fault injection not supported yet")
        status = integer(a, "httpStatus", 0) or 0
        grpc_status = a.get("grpcStatus", str, "")
        if bool(status) == bool(grpc_status):
            raise f.fail(f"{path}.abort: exactly one of httpStatus or grpcStatus is required")
        if status and not 200 <= status <= 599:
            raise f.fail(f"{path}.abort.httpStatus: invalid abort http status {status}")
        if grpc_status and grpc_status not in GRPC_CODES:
            raise f.fail(f"{path}.abort.grpcStatus: {grpc_status!r} is not a gRPC status code name")
        abort = FaultAbort(status, grpc_status, _percent(a))
    if delay is None and abort is None:
        raise f.fail(f"{path}: HTTP fault injection must have an abort and/or a delay")
    return Fault(delay, abort)


def _percent(f: _Fields) -> float:
    """`percentage: {value: x}`, or the deprecated integer `percent`; 100 when neither is given."""
    value = percentage(f, "percentage")
    if value is None and (legacy := integer(f, "percent", 0, 100)) is not None:
        value = float(legacy)
    return 100.0 if value is None else value


def _retries(f: _Fields, path: str) -> Retries | None:
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("attempts", "perTryTimeout", "retryOn", "retryRemoteLocalities", "retryIgnorePreviousHosts", "backoff"))
    attempts = sub.get("attempts", int, 0)
    if attempts < 0:
        raise f.fail(f"{path}.attempts: attempts cannot be negative")
    per_try = duration(sub, "perTryTimeout")
    retry_on = tuple(p.strip() for p in sub.get("retryOn", str, "").split(",") if p.strip())
    remote = sub.get("retryRemoteLocalities", bool, None)
    if attempts == 0 and (per_try is not None or retry_on or remote is not None):
        raise f.fail(f"{path}: http retry policy configured when attempts are set to 0 (disabled)")
    for policy in retry_on:
        if policy not in RETRY_ON and not (policy.isdigit() and 100 <= int(policy) <= 599):
            raise f.fail(f"{path}.retryOn: {policy!r} is not a valid retryOn policy")
    return Retries(attempts, per_try, retry_on, remote, duration(sub, "backoff"),
                   sub.get("retryIgnorePreviousHosts", bool, None))


def _rewrite(f: _Fields, path: str) -> Rewrite | None:
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("uri", "authority", "uriRegexRewrite"))
    uri, authority = sub.get("uri", str, ""), sub.get("authority", str, "")
    uri_regex = None
    if (r := fields(sub, "uriRegexRewrite")) is not None:
        only(r, ("match", "rewrite"))
        match = r.get("match", str, "")
        if not match:
            raise f.fail(f"{path}.uriRegexRewrite.match is required")
        regex(f, f"{path}.uriRegexRewrite.match", match)
        uri_regex = (match, r.get("rewrite", str, ""))
    if not (uri or authority or uri_regex):
        raise f.fail(f"{path}: rewrite must specify URI, authority, or uriRegexRewrite")
    if uri and uri_regex:
        raise f.fail(f"{path}: rewrite may only contain one of URI or uriRegexRewrite")
    return Rewrite(uri, authority, uri_regex)


_REDIRECT_CODES = (301, 302, 303, 307, 308)  # the codes Envoy's redirect action has
_DERIVE_PORT = ("FROM_PROTOCOL_DEFAULT", "FROM_REQUEST_PORT")


def _redirect(f: _Fields, path: str, matches: tuple[HTTPMatch, ...]) -> Redirect | None:
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("uri", "authority", "port", "derivePort", "scheme", "redirectCode", "prefixRewrite"))
    if "port" in sub.body and "derivePort" in sub.body:
        raise f.fail(f"{path}: only one of port or derivePort")
    derive = sub.get("derivePort", str, "")
    if derive and derive not in _DERIVE_PORT:
        raise f.fail(f"{path}.derivePort: {derive!r} is not one of {', '.join(_DERIVE_PORT)}")
    redirect = Redirect(sub.get("uri", str, ""), sub.get("authority", str, ""), sub.get("scheme", str, ""),
                        port(sub, "port") or 0, derive, integer(sub, "redirectCode", 0) or 301,
                        sub.get("prefixRewrite", str, ""))
    if redirect.uri and redirect.prefix_rewrite:
        raise f.fail(f"{path}: redirect may only specify one of uri or prefix_rewrite")
    if redirect.prefix_rewrite and any(m.uri is not None and m.uri.kind is not MatchKind.PREFIX for m in matches):
        raise f.fail(f"{path}: redirect prefix_rewrite requires all URI matches to use prefix match type")
    if not (redirect.uri or redirect.prefix_rewrite or redirect.authority or redirect.scheme or "port" in sub.body
            or derive):
        raise f.fail(f"{path}: redirect must specify URI, authority, scheme, or port")
    if redirect.code not in _REDIRECT_CODES:
        raise f.fail(f"{path}.redirectCode: {redirect.code} is not one of {', '.join(map(str, _REDIRECT_CODES))}")
    if redirect.scheme not in ("", "http", "https"):
        raise f.fail(f'{path}.scheme: invalid redirect scheme, must be "http" or "https"')
    return redirect


_MAX_BODY = 1 << 20  # istiod refuses larger direct response bodies


def _direct_response(f: _Fields, path: str) -> DirectResponse | None:
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("status", "body"))
    status = integer(sub, "status", 0) or 0
    if not 200 <= status <= 599:
        raise f.fail(f"{path}.status: HTTP status {status} is not in range 200-599")
    body: str | bytes | None = None
    if (b := fields(sub, "body")) is not None:
        only(b, ("string", "bytes"))
        if len(b.body) != 1:
            raise f.fail(f"{path}.body: exactly one of string or bytes")
        if "string" in b.body:
            body = b.get("string", str, "")
        else:
            try:
                body = base64.b64decode(b.get("bytes", str, ""), validate=True)
            except binascii.Error:
                raise f.fail(f"{path}.body.bytes: not base64") from None
        if len(body.encode() if isinstance(body, str) else body) > _MAX_BODY:
            raise f.fail(f"{path}.body: large direct_responses may impact control plane performance, must be less than 1MB")
    return DirectResponse(status, body)


def _mirrors(r: _Fields, namespace: str, domain: str) -> tuple[Mirror, ...]:
    """`mirror` with `mirrorPercentage` (or the deprecated integer `mirrorPercent`), or `mirrors`."""
    if "mirror" in r.body and "mirrors" in r.body:
        raise r.fail("HTTP route cannot contain both mirror and mirrors")
    result = []
    for i, item in enumerate(items(r, "mirrors")):
        only(item, ("destination", "percentage"))
        value = percentage(item, "percentage")
        result.append(Mirror(_destination(item, "destination", namespace, domain), 100 if value is None else value))
    if "mirror" in r.body:
        value = percentage(r, "mirrorPercentage")
        # The deprecated integer, by its JSON or its CRD name.
        legacy = integer(r, "mirrorPercent", 0, 100) if "mirrorPercent" in r.body else integer(r, "mirror_percent", 0, 100)
        share: float | int = value if value is not None else legacy if legacy is not None else 100
        result.append(Mirror(_destination(r, "mirror", namespace, domain), share))
    return tuple(result)


_CORS_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "CONNECT", "OPTIONS", "TRACE", "*"})
_UNMATCHED_PREFLIGHTS = ("FORWARD", "IGNORE")


def _cors_policy(r: _Fields, path: str) -> CorsPolicy | None:
    """As istiod's validateCORSPolicy; the deprecated `allowOrigin` list is exact origins."""
    sub = fields(r, path)
    if sub is None:
        return None
    only(sub, ("allowOrigins", "allowOrigin", "allowMethods", "allowHeaders", "exposeHeaders", "maxAge",
               "allowCredentials", "unmatchedPreflights"))
    origins = string_match_list(sub, "allowOrigins")
    for i, origin in enumerate(origins):
        if not origin.value:
            raise r.fail(f"{path}.allowOrigins[{i}]: '' is not a valid match type for CORS allow origins")
    if "allowOrigins" not in sub.body:
        origins = tuple(StringMatch(MatchKind.EXACT, o) for o in str_list(sub, "allowOrigin"))
    methods = str_list(sub, "allowMethods")
    for method in methods:
        if method not in _CORS_METHODS:
            raise r.fail(f"{path}.allowMethods: {method!r} is not a supported HTTP method")
    for name in ("allowHeaders", "exposeHeaders"):
        for header in str_list(sub, name):
            if header != "*" and not _HEADER_NAME.fullmatch(header):
                raise r.fail(f"{path}.{name}: header name {header!r} is not a valid header name")
    max_age = duration(sub, "maxAge")
    if max_age is not None and max_age % timedelta(seconds=1):
        raise r.fail(f"{path}.maxAge: max_age duration is accurate only to seconds precision")
    unmatched = sub.get("unmatchedPreflights", str, "FORWARD")
    if unmatched not in _UNMATCHED_PREFLIGHTS:
        raise r.fail(f"{path}.unmatchedPreflights: {unmatched!r} is not one of {', '.join(_UNMATCHED_PREFLIGHTS)}")
    return CorsPolicy(origins, methods, str_list(sub, "allowHeaders"), str_list(sub, "exposeHeaders"),
                      max_age, sub.get("allowCredentials", bool, None), unmatched)


def _delegate(r: _Fields, namespace: str, in_delegate: bool) -> tuple[str, str] | None:
    """A root's `delegate: {name, namespace}` (its own namespace by default), as istiod validates it."""
    sub = fields(r, "delegate")
    if sub is None:
        return None
    if in_delegate:
        raise r.fail("delegate HTTP route cannot contain delegate")
    only(sub, ("name", "namespace"))
    name, delegate_namespace = sub.get("name", str, ""), sub.get("namespace", str, "") or namespace
    if not name:
        raise r.fail("delegate.name is required")
    for field_name, value in (("name", name), ("namespace", delegate_namespace)):
        if not dns1123_label(value):
            raise r.fail(f"delegate.{field_name}: {value!r} is not a valid name")
    if "route" in r.body or "redirect" in r.body:
        raise r.fail(f"root HTTP route {r.get('name', str, '')} must not specify "
                     f"{'route' if 'route' in r.body else 'redirect'}")
    return delegate_namespace, name


def _http_route(r: _Fields, namespace: str, domain: str, in_delegate: bool) -> HTTPRoute:
    only(r, ("name", "match", "route", "redirect", "directResponse", "rewrite", "timeout", "retries", "fault",
             "headers", "mirror", "mirrors", "mirrorPercentage", "mirrorPercent", "mirror_percent", "corsPolicy",
             "delegate"))
    delegate = _delegate(r, namespace, in_delegate)
    route = _route_destinations(r, "route", namespace, domain)
    matches = tuple(_http_match(m, namespace, domain) for m in items(r, "match"))
    redirect, direct = _redirect(r, "redirect", matches), _direct_response(r, "directResponse")
    rewrite, headers = _rewrite(r, "rewrite"), _headers(r, "headers")
    if redirect is not None or direct is not None:  # istiod's validateHTTPRouteConflict: one action
        action = "redirect" if redirect is not None else "direct_response"
        conflicts = {"route": bool(route), "fault": "fault" in r.body, "rewrite": rewrite is not None,
                     "direct_response": redirect is not None and direct is not None}
        for other, present in conflicts.items():
            if present:
                raise r.fail(f"HTTP route cannot contain both {other} and {action}")
    if not (route or redirect or direct or delegate):
        raise r.fail("HTTP route, redirect or direct_response is required")
    authorities = [v for k, v in headers.request.set + headers.request.add if k.lower() in (":authority", "host")]
    if len(authorities) + bool(rewrite and rewrite.authority) > 1:
        raise r.fail("authority header cannot be set multiple times")
    return HTTPRoute(
        name=r.get("name", str, ""),
        match=matches,
        route=route,
        redirect=redirect,
        direct_response=direct,
        rewrite=rewrite,
        timeout=duration(r, "timeout"),
        retries=_retries(r, "retries"),
        fault=_fault(r, "fault"),
        headers=headers,
        mirrors=_mirrors(r, namespace, domain),
        cors_policy=_cors_policy(r, "corsPolicy"),
        delegate=delegate,
    )


def _l4_route(r: _Fields, namespace: str, domain: str, tls: bool, hosts: tuple[str, ...]) -> L4Route:
    only(r, ("match", "route"))
    matches = []
    for m in items(r, "match"):
        only(m, ("destinationSubnets", "port", "sourceLabels", "gateways", "sourceNamespace")
             + (("sniHosts",) if tls else ()), () if tls else ("sniHosts",))
        for i, subnet in enumerate(str_list(m, "destinationSubnets")):
            ip_or_cidr(m, f"destinationSubnets[{i}]", subnet)
        sni = str_list(m, "sniHosts")
        if tls and not sni:
            raise m.fail("TLS match must have at least one SNI host")
        for name in sni:
            raise_if(m, wildcard_domain_error(name), "sniHosts")
            if not any(host_matches(h, resolve_host(name, namespace, domain)) for h in hosts):
                raise m.fail(f"sniHosts: the SNI host {name!r} is not a subset of any of the virtual service hosts")
        matches.append(L4Match(str_list(m, "destinationSubnets"), port(m, "port") or 0, labels(m, "sourceLabels"),
                               _gateway_refs(m, "gateways", namespace), _source_namespace(m), sni))
    if tls and not matches:
        raise r.fail("TLS route must have at least one match condition")
    route = _route_destinations(r, "route", namespace, domain)
    if not route:
        raise r.fail("route is required")
    return L4Route(tuple(matches), route)


def virtual_service(key: ObjectKey, f: _Fields, domain: str) -> VirtualService:
    spec(f, ("hosts", "gateways", "http", "tcp", "tls", "exportTo"))
    hosts = str_list(f, "spec.hosts")
    delegate = not hosts  # its http routes stand in roots' delegating routes
    if delegate:
        for name in ("gateways", "tls", "tcp"):
            if f.get(f"spec.{name}", list, []):
                raise f.fail(f"spec.{name}: delegate virtual service must have no "
                             f"{'gateways specified' if name == 'gateways' else name + ' route specified'}")
    gateways = _gateway_refs(f, "spec.gateways", key.namespace) or (MESH_GATEWAY,)
    for i, host in enumerate(hosts):
        if host == "*" and MESH_GATEWAY in gateways:
            raise f.fail(f"spec.hosts[{i}]: wildcard host * is not allowed for virtual services bound to the mesh gateway")
        if (error := wildcard_domain_error(host)) and not is_ip(host):
            raise f.fail(f"spec.hosts[{i}]: {error}")
    resolved = tuple(resolve_host(h, key.namespace, domain) for h in hosts)
    if not any(f.get(f"spec.{p}", list, []) for p in ("http", "tcp", "tls")):
        raise f.fail("spec: http, tcp or tls must be provided in virtual service")
    return VirtualService(
        meta=meta(key),
        hosts=resolved,
        gateways=gateways,
        http=tuple(_http_route(r, key.namespace, domain, delegate) for r in items(f, "spec.http")),
        tcp=tuple(_l4_route(r, key.namespace, domain, False, resolved) for r in items(f, "spec.tcp")),
        tls=tuple(_l4_route(r, key.namespace, domain, True, resolved) for r in items(f, "spec.tls")),
        export_to=export_to(f),
    )


# --- DestinationRule --------------------------------------------------------------------------

def _load_balancer(f: _Fields, path: str) -> LoadBalancerSettings | None:
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("simple", "consistentHash", "localityLbSetting", "warmupDurationSecs", "warmup"),
         ("zoneAwareLbSetting",))
    simple = enum_field(sub, "simple", LoadBalancer, "UNSPECIFIED") if "simple" in sub.body else None
    consistent = _consistent_hash(sub, "consistentHash")
    if simple is not None and consistent is not None:
        raise f.fail(f"{path}: only one of simple or consistentHash")
    warmup = None
    if (w := fields(sub, "warmup")) is not None:
        only(w, ("duration", "aggression", "minimumPercent"))
        window = duration(w, "duration")
        if window is None:
            raise w.fail("duration is required")
        aggression = w.get("aggression", (int, float), 1.0)
        if "aggression" in w.body and aggression <= 0:
            raise w.fail("aggression should be greater than 0")
        minimum = w.get("minimumPercent", (int, float), 10.0)
        if minimum > 100 or minimum < 0:
            raise w.fail("minimumPercent value should be less than or equal to 100")
        warmup = Warmup(window, float(aggression), float(minimum))
    elif (window := duration(sub, "warmupDurationSecs")) is not None:
        warmup = Warmup(window)
    return LoadBalancerSettings(simple, consistent, locality_lb_setting(sub, "localityLbSetting"),  # type: ignore[arg-type]
                                warmup, warmup_window_only=warmup is not None and "warmup" not in sub.body)


def _consistent_hash(f: _Fields, path: str) -> ConsistentHash | None:
    """Istio's consistentHash: one hash key, and the ring hash (or maglev) that spreads it; the
    top-level minimumRingSize is the deprecated form of ringHash.minimumRingSize."""
    c = fields(f, path)
    if c is None:
        return None
    only(c, ("httpHeaderName", "httpCookie", "useSourceIp", "httpQueryParameterName", "minimumRingSize",
             "ringHash", "maglev"))
    keys = [k for k in ("httpHeaderName", "httpCookie", "useSourceIp", "httpQueryParameterName") if k in c.body]
    if len(keys) != 1:
        raise c.fail("exactly one hash key is required")
    if c.body.get("httpHeaderName") == "":
        raise c.fail("httpHeaderName: header name required")
    if c.body.get("httpQueryParameterName") == "":
        raise c.fail("httpQueryParameterName: query parameter name required")
    cookie = None
    if (k := fields(c, "httpCookie")) is not None:
        only(k, ("name", "path", "ttl", "attributes"))
        if not k.get("name", str, ""):
            raise k.fail("name: cookie name is required")
        attributes: list[tuple[str, str]] = []
        for i, a in enumerate(items(k, "attributes")):
            only(a, ("name", "value"))
            name = a.get("name", str, "")
            if not name:
                raise k.fail(f"attributes[{i}].name: cookie attribute name cannot be empty")
            if any(n == name for n, _ in attributes):
                raise k.fail(f"attributes[{i}].name: duplicate cookie attribute name: {name}")
            attributes.append((name, a.get("value", str, "")))
        cookie = HTTPCookie(k.get("name", str, ""), k.get("path", str, ""), duration(k, "ttl", check=False),
                            tuple(attributes))
    algorithm, size = None, 0
    if (r := fields(c, "ringHash")) is not None:
        only(r, ("minimumRingSize",))
        algorithm, size = HashAlgorithm.RING_HASH, integer(r, "minimumRingSize", 0) or 0
    if (m := fields(c, "maglev")) is not None:
        if algorithm is not None:
            raise c.fail("only one of ringHash or maglev")
        only(m, ("tableSize",))
        algorithm, size = HashAlgorithm.MAGLEV, integer(m, "tableSize", 0) or 0
        if size == 0:
            raise m.fail("tableSize: tableSize must be set for maglev")
        if size >= 5000011:
            raise m.fail("tableSize: tableSize must be less than 5000011 for maglev")
        if not _is_prime(size):
            raise m.fail("tableSize: tableSize must be a prime number for maglev")
    minimum_ring_size = integer(c, "minimumRingSize", 0) or 0
    if minimum_ring_size and algorithm is not None:
        raise c.fail("only one of MinimumRingSize or Maglev/Ringhash can be specified")
    if minimum_ring_size:
        # A warning in Istio's validation too.
        log.warning("%s.minimumRingSize: consistent hash MinimumRingSize is deprecated, use "
                    "ConsistentHashLB's RingHash configuration instead", path)
    return ConsistentHash(c.get("httpHeaderName", str, ""), cookie, c.get("useSourceIp", bool, False),
                          c.get("httpQueryParameterName", str, ""), minimum_ring_size, algorithm, size)


def _is_prime(n: int) -> bool:
    """Envoy's (and so Istio's) primality check for the maglev table size."""
    if 0 < n < 4:
        return True
    if n % 2 == 0:
        return False
    return all(n % factor for factor in range(3, math.isqrt(n) + 1, 2))


_TOPOLOGY_LABELS = ("topology.kubernetes.io/region", "topology.kubernetes.io/zone", "topology.istio.io/subzone")


def locality_lb_setting(f: _Fields, path: str) -> LocalityLbSetting | None:
    """A DestinationRule's or the mesh config's localityLbSetting, with Istio's validation
    (ValidateLocalityLbSetting): errors name the field."""
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("distribute", "failover", "failoverPriority", "enabled"))
    distribute = []
    for d in items(sub, "distribute"):
        only(d, ("from", "to"))
        to = str_keyed(d, "to")
        for name, weight in to.items():
            if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= 100:
                raise d.fail(f"to[{name!r}]: locality weight must be in range [1, 100]")
        if (total := sum(to.values())) != 100:
            raise d.fail(f"to: total locality weight {total} != 100")
        raise_if(d, _localities_error(list(to)), "to")
        distribute.append(LocalityDistribute(d.get("from", str, ""), tuple(to.items())))
    raise_if(sub, _localities_error([d.from_locality for d in distribute]), "distribute")
    failover = []
    for o in items(sub, "failover"):
        only(o, ("from", "to"))
        source, target = o.get("from", str, ""), o.get("to", str, "")
        if source == target:
            raise o.fail("locality lb failover settings must specify different regions")
        if "/" in source or "/" in target:
            raise o.fail("locality lb failover only specify region")
        if "*" in source or "*" in target:
            raise o.fail("locality lb failover region should not contain '*' wildcard")
        failover.append(LocalityFailover(source, target))
    if distribute and failover:
        raise sub.fail("can not simultaneously specify 'distribute' and 'failover'")
    priority = str_list(sub, "failoverPriority")
    if failover and (topology := next((p for p in priority if p in _TOPOLOGY_LABELS), None)):
        raise sub.fail(f"failoverPriority: can not simultaneously set 'failover' and topology label '{topology}'")
    return LocalityLbSetting(tuple(distribute), tuple(failover), priority, sub.get("enabled", bool, None))


def _localities_error(localities: list[str]) -> str | None:
    """Istio's validateLocalities: `region[/zone[/subzone]]`, a `*` only last, none overlapping one
    before it (in Istio's order-dependent way: `r/*` after `r/z` passes, `r/z` after `r/*` does not)."""
    seen: dict[str, dict[str, dict[str, bool]]] = {}  # region -> zone -> subzone, "*" for all
    for locality in localities:
        stars = locality.count("*")
        if stars > 1 or (stars and not locality.endswith("*")):
            return f"locality {locality} wildcard '*' number can not exceed 1 and must be in the end"
        parts = locality.split("/", 2)
        if not all(parts):
            return f"locality {locality} must not contain empty region/zone/subzone info"
        overlap = f"locality {locality} overlap with previous specified ones"
        if "*" in seen:
            return overlap
        zones = seen.get(parts[0])
        if len(parts) == 1:
            if zones is not None:
                return overlap
            seen[parts[0]] = {"*": {"*": True}}
        elif zones is None:
            seen[parts[0]] = {parts[1]: {parts[2] if len(parts) == 3 else "*": True}}
        elif "*" in zones:
            return overlap
        elif len(parts) == 2:
            if parts[1] in zones:
                return overlap
            zones[parts[1]] = {"*": True}
        else:
            subzones = zones.setdefault(parts[1], {})
            if subzones.get("*") or subzones.get(parts[2]):
                return overlap
            subzones[parts[2]] = True
    return None


def _connection_pool(f: _Fields, path: str) -> ConnectionPool | None:
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("tcp", "http"))
    if not sub.body:
        raise f.fail(f"{path}: connection pool must have at least one field")
    tcp = http = None
    if (t := fields(sub, "tcp")) is not None:
        only(t, ("maxConnections", "connectTimeout", "tcpKeepalive", "maxConnectionDuration", "idleTimeout"))
        keepalive = None
        if (k := fields(t, "tcpKeepalive")) is not None:
            only(k, ("probes", "time", "interval"))
            keepalive = TcpKeepalive(integer(k, "probes", 0) or 0, duration(k, "time"), duration(k, "interval"))
        tcp = TCPSettings(integer(t, "maxConnections", 0) or 0, duration(t, "connectTimeout"), keepalive,
                          duration(t, "maxConnectionDuration"), duration(t, "idleTimeout"))
    if (h := fields(sub, "http")) is not None:
        only(h, ("http1MaxPendingRequests", "http2MaxRequests", "maxRequestsPerConnection", "maxRetries",
                 "idleTimeout", "maxConcurrentStreams", "h2UpgradePolicy", "useClientProtocol"))
        http = HTTPSettings(
            http1_max_pending_requests=integer(h, "http1MaxPendingRequests", 0) or 0,
            http2_max_requests=integer(h, "http2MaxRequests", 0) or 0,
            max_requests_per_connection=integer(h, "maxRequestsPerConnection", 0) or 0,
            max_retries=integer(h, "maxRetries", 0) or 0,
            idle_timeout=duration(h, "idleTimeout"),
            max_concurrent_streams=integer(h, "maxConcurrentStreams", 0) or 0,
            h2_upgrade_policy=enum_field(h, "h2UpgradePolicy", H2UpgradePolicy, "DEFAULT"),  # type: ignore[arg-type]
            use_client_protocol=h.get("useClientProtocol", bool, False),
        )
    return ConnectionPool(tcp, http)


def _outlier_detection(f: _Fields, path: str) -> OutlierDetection | None:
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("consecutive5xxErrors", "consecutiveGatewayErrors", "interval", "baseEjectionTime",
               "maxEjectionPercent", "minHealthPercent", "splitExternalLocalOriginErrors",
               "consecutiveLocalOriginFailures"), ("consecutiveErrors",))
    return OutlierDetection(
        consecutive_5xx_errors=integer(sub, "consecutive5xxErrors", 0),
        consecutive_gateway_errors=integer(sub, "consecutiveGatewayErrors", 0),
        interval=duration(sub, "interval"),
        base_ejection_time=duration(sub, "baseEjectionTime"),
        max_ejection_percent=integer(sub, "maxEjectionPercent", 0, 100),
        min_health_percent=integer(sub, "minHealthPercent", 0, 100),
        split_external_local_origin_errors=sub.get("splitExternalLocalOriginErrors", bool, False),
        consecutive_local_origin_failures=integer(sub, "consecutiveLocalOriginFailures", 0),
    )


def _client_tls(f: _Fields, path: str) -> ClientTLS | None:
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("mode", "clientCertificate", "privateKey", "caCertificates", "subjectAltNames", "sni",
               "insecureSkipVerify", "caCrl", "credentialName"))
    tls = ClientTLS(enum_field(sub, "mode", TLSMode, "DISABLE"), sub.get("clientCertificate", str, ""),  # type: ignore[arg-type]
                    sub.get("privateKey", str, ""), sub.get("caCertificates", str, ""),
                    str_list(sub, "subjectAltNames"), sub.get("sni", str, ""), sub.get("insecureSkipVerify", bool, None),
                    sub.get("caCrl", str, ""), sub.get("credentialName", str, ""))
    scheme, sep, _ = tls.credential_name.partition("://")
    if sep and scheme != "kubernetes":  # configmap://, sds://, builtin://
        raise f.fail(f"{path}.credentialName: {scheme}:// credentials are not supported by this istiod")
    if tls.insecure_skip_verify and tls.mode is TLSMode.SIMPLE and (
            tls.ca_certificates or tls.credential_name or tls.subject_alt_names):
        raise f.fail(f"{path}: cannot specify CaCertificates or CredentialName or SubjectAltNames when "
                     "InsecureSkipVerify is set true")
    if tls.credential_name and tls.mode in (TLSMode.SIMPLE, TLSMode.MUTUAL):
        # istiod's validation: the Secret holds the certificates (and its CRL), not files.
        if tls.client_certificate or tls.private_key or tls.ca_certificates or tls.ca_crl:
            raise f.fail(f"{path}: cannot specify client certificates or CA certificate or CA CRL If credentialName is set")
    elif tls.mode is TLSMode.MUTUAL:
        if not tls.client_certificate:
            raise f.fail(f"{path}: client certificate required for mutual tls")
        if not tls.private_key:
            raise f.fail(f"{path}: private key required for mutual tls")
    return tls


_POLICY_FIELDS = ("loadBalancer", "connectionPool", "outlierDetection", "tls")
_PROXY_PROTOCOL_VERSIONS = {"V1": 1, "V2": 2}


def _tunnel(f: _Fields, path: str) -> TunnelSettings | None:
    """istiod's validateTunnelSettings, every error of the object at once as istiod reports them."""
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("protocol", "targetHost", "targetPort"))
    protocol, host = sub.get("protocol", str, ""), sub.get("targetHost", str, "")
    target_port = sub.get("targetPort", int, 0)
    errors = []
    if protocol not in ("", "CONNECT", "POST"):
        errors.append('tunnel protocol must be "CONNECT" or "POST"')
    if (host_error := fqdn_error(host)) is not None and not is_ip(host):
        errors.append(f"tunnel target host must be valid FQDN or IP address: {host_error}; {host} is not a valid IP")
    if not 1 <= target_port <= 65535:
        errors.append(f"tunnel target port is invalid: port number {target_port} must be in the range 1..65535")
    if errors:
        raise sub.fail("; ".join(errors))
    return TunnelSettings(host, target_port, protocol == "POST")


def _traffic_policy(f: _Fields, path: str) -> TrafficPolicy | None:
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, _POLICY_FIELDS + ("portLevelSettings", "proxyProtocol", "tunnel", "retryBudget"))
    if not sub.body:
        raise f.fail(f"{path}: traffic policy must have at least one field")
    if "tunnel" in sub.body and "proxyProtocol" in sub.body:
        raise f.fail(f"{path}: tunnel and proxyProtocol must not be set together")
    proxy_protocol = None
    if (pp := fields(sub, "proxyProtocol")) is not None:
        only(pp, ("version",))
        version = pp.get("version", str, "V1")
        if version not in _PROXY_PROTOCOL_VERSIONS:
            raise pp.fail(f"version: proxy protocol version is invalid: {version!r} (V1 or V2)")
        proxy_protocol = _PROXY_PROTOCOL_VERSIONS[version]
    port_level = []
    for p in items(sub, "portLevelSettings"):
        only(p, _POLICY_FIELDS + ("port",))
        number = port(p, "port.number")
        if number is None:
            raise p.fail("portTrafficPolicy must have valid port")
        if len(p.body) == 1:
            raise p.fail("port traffic policy must have at least one field")
        port_level.append(PortTrafficPolicy(number, *_policy_parts(p)))
    return TrafficPolicy(*_policy_parts(sub), port_level_settings=tuple(port_level), proxy_protocol=proxy_protocol,
                         tunnel=_tunnel(sub, "tunnel"), retry_budget=_retry_budget(sub, "retryBudget"))


def _retry_budget(f: _Fields, path: str) -> RetryBudget | None:
    """As Istio's CRD checks it: a percent of 0-100 (a DoubleValue: a plain number); any interval."""
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("percent", "minRetryConcurrency", "budgetInterval"))
    percent = sub.get("percent", (int, float), None)
    if percent is not None and not 0 <= percent <= 100:
        raise sub.fail(f"percent: {percent} is not in range 0..100")
    return RetryBudget(None if percent is None else float(percent), integer(sub, "minRetryConcurrency", 0, 2**32 - 1) or 0,
                       duration(sub, "budgetInterval", check=False))


def _policy_parts(f: _Fields) -> tuple[LoadBalancerSettings | None, ConnectionPool | None,
                                       OutlierDetection | None, ClientTLS | None]:
    lb, outlier = _load_balancer(f, "loadBalancer"), _outlier_detection(f, "outlierDetection")
    locality = lb.locality_lb_setting if lb is not None else None
    if locality is not None and (locality.failover or locality.failover_priority) and outlier is None:
        # A warning in Istio's validation too: without it the failover never happens.
        log.warning("%s.loadBalancer.localityLbSetting: outlier detection policy must be provided for failover", f.key)
    return lb, _connection_pool(f, "connectionPool"), outlier, _client_tls(f, "tls")


def destination_rule(key: ObjectKey, f: _Fields, domain: str) -> DestinationRule:
    spec(f, ("host", "trafficPolicy", "subsets", "exportTo", "workloadSelector"))
    host = f.get("spec.host", str, "")
    if not host:
        raise f.fail("spec.host is required")
    raise_if(f, wildcard_domain_error(host), "spec.host")
    subsets: list[Subset] = []
    for i, s in enumerate(items(f, "spec.subsets")):
        only(s, ("name", "labels", "trafficPolicy"))
        name = s.get("name", str, "")
        if not dns1123_label(name):
            raise f.fail(f"spec.subsets[{i}].name: subset name is invalid: {name!r}")
        if any(existing.name == name for existing in subsets):
            raise f.fail(f"spec.subsets[{i}].name: duplicate subset names: {name}")
        subsets.append(Subset(name, labels(s, "labels"), _traffic_policy(s, "trafficPolicy")))
    return DestinationRule(meta(key), resolve_host(host, key.namespace, domain), _traffic_policy(f, "spec.trafficPolicy"),
                           tuple(subsets), export_to(f), workload_selector(f, "spec.workloadSelector"))


# --- ServiceEntry, WorkloadEntry --------------------------------------------------------------

def _required(f: _Fields, path: str) -> _Fields:
    sub = fields(f, path)
    if sub is None:
        raise f.fail(f"{path} is required")
    return sub


def _service_port(sub: _Fields, sniffed: bool = False) -> ServicePort:
    only(sub, ("number", "protocol", "name", "targetPort"))
    number = port(sub, "number")
    if number is None:
        raise sub.fail("number is required")
    name = sub.get("name", str, "")
    if name and not dns1123_label(name):
        raise sub.fail(f"name: invalid port name: {name}")
    return ServicePort(number, protocol(sub, "protocol", sniffed), name, port(sub, "targetPort") or 0)


def _workload_entry(f: _Fields, meta: Meta, port_names: set[str] | None) -> WorkloadEntry:
    address = f.get("address", str, "")
    if address.startswith("unix://"):
        raise f.fail("address: unix domain socket endpoints are not supported by this istiod")
    if address and fqdn_error(address) and not is_ip(address):
        raise f.fail(f"address: endpoint address {address!r} is not a valid FQDN or an IP address")
    ports = []
    for name, number in sorted(str_keyed(f, "ports").items()):
        if port_names is not None and name not in port_names:
            raise f.fail(f"ports: endpoint port {name} is not defined by the service entry")
        if not dns1123_label(name):
            raise f.fail(f"ports: invalid port name: {name}")
        if isinstance(number, bool) or not isinstance(number, int) or not 0 < number < 65536:
            raise f.fail(f"ports.{name}: {number!r} is not in 1-65535")
        ports.append((name, number))
    return WorkloadEntry(meta, address, tuple(ports), labels(f, "labels"), f.get("network", str, ""),
                         f.get("locality", str, ""), integer(f, "weight", 0) or 0, f.get("serviceAccount", str, ""))


_ENDPOINT_FIELDS = ("address", "ports", "labels", "network", "locality", "weight", "serviceAccount")


def workload_entry(key: ObjectKey, f: _Fields, domain: str) -> WorkloadEntry:
    body = spec(f, _ENDPOINT_FIELDS)
    if not body.get("address", str, "") and not body.get("network", str, ""):
        raise f.fail("spec.address must be set")
    entry = _workload_entry(body, meta(key), None)
    checked = f.get("metadata.annotations", dict, {}).get(HEALTH_CHECKS_ANNOTATION, "")
    if str(checked).lower() not in ("true", "1", "t"):  # Go's ParseBool; anything else: not checked
        return entry
    # Unhealthy until its agent's probe says otherwise (istiod's isHealthy).
    conditions = f.get("status.conditions", list, [])
    healthy = any(isinstance(c, dict) and c.get("type") == "Healthy" and c.get("status") == "True" for c in conditions)
    return dataclasses.replace(entry, healthy=healthy)


def workload_group(key: ObjectKey, f: _Fields, domain: str) -> WorkloadGroup:
    """Istio's ValidateWorkloadGroup: a template (an entry without its address), labels as Kubernetes'
    rules, and a probe as validateReadinessProbe."""
    body = spec(f, ("metadata", "template", "probe"))
    group_meta = fields(body, "metadata")
    if group_meta is not None:
        only(group_meta, ("labels", "annotations"))
    template = fields(body, "template")
    if template is None:
        raise f.fail("spec.template: template is required")
    only(template, _ENDPOINT_FIELDS)
    probe = None
    if (probe_body := fields(body, "probe")) is not None:
        try:
            probe = parse_readiness_probe(probe_body.body)
        except ProbeError as error:
            raise f.fail(f"spec.probe: {error}") from None
    return WorkloadGroup(meta(key), f.get("metadata.uid", str, ""),
                         labels(group_meta, "labels") if group_meta else (),
                         group_meta.str_map("annotations") if group_meta else (),
                         _workload_entry(template, meta(key), None), probe)


def service_entry(key: ObjectKey, f: _Fields, domain: str) -> ServiceEntry:
    spec(f, ("hosts", "addresses", "ports", "location", "resolution", "endpoints", "workloadSelector", "exportTo",
              "subjectAltNames"))
    hosts = str_list(f, "spec.hosts")
    if not hosts:
        raise f.fail("spec.hosts: service entry must have at least one host")
    for i, host in enumerate(hosts):
        if host == "*":
            raise f.fail(f"spec.hosts[{i}]: invalid host {host}")
        raise_if(f, wildcard_domain_error(host), f"spec.hosts[{i}]")
    addresses = str_list(f, "spec.addresses")
    for i, address in enumerate(addresses):
        ip_or_cidr(f, f"spec.addresses[{i}]", address)
    resolution: Resolution = enum_field(f, "spec.resolution", Resolution, "NONE")  # type: ignore[assignment]
    if any("/" in a for a in addresses) and resolution not in (Resolution.NONE, Resolution.STATIC):
        raise f.fail("spec.addresses: CIDR addresses are allowed only for NONE/STATIC resolution types")
    ports: list[ServicePort] = []
    for i, item in enumerate(items(f, "spec.ports")):
        p = _service_port(item, sniffed=True)
        if any(o.name == p.name for o in ports):
            raise f.fail(f"spec.ports[{i}].name: service entry port name {p.name!r} already defined")
        if any(o.number == p.number for o in ports):
            raise f.fail(f"spec.ports[{i}].number: service entry port {p.number} already defined")
        ports.append(p)
    names = {p.name for p in ports}
    owner = meta(key)
    endpoints = tuple(_workload_entry(e, owner, names) for e in items(f, "spec.endpoints"))
    selector = _labels_selector(f)
    if "workloadSelector" in (f.get("spec", dict, {})) and endpoints:
        raise f.fail("spec: only one of WorkloadSelector or Endpoints is allowed in Service Entry")
    if resolution is Resolution.NONE and endpoints:
        raise f.fail("spec.endpoints: no endpoints should be provided for resolution type none")
    if resolution is Resolution.STATIC:
        for i, e in enumerate(endpoints):
            if not is_ip(e.address):
                raise f.fail(f"spec.endpoints[{i}].address: {e.address!r} is not an IP address (resolution STATIC)")
    if resolution in (Resolution.DNS, Resolution.DNS_ROUND_ROBIN) and not endpoints:
        for host in hosts:
            if host.startswith("*") or fqdn_error(host):
                raise f.fail("spec.hosts: hosts must be FQDN if no endpoints are provided for resolution mode DNS")
    if resolution is Resolution.DNS_ROUND_ROBIN and len(endpoints) > 1:
        raise f.fail("spec.endpoints: there must only be 0 or 1 endpoint for resolution mode DNS_ROUND_ROBIN")
    return ServiceEntry(owner, tuple(resolve_host(h, key.namespace, domain) for h in hosts), tuple(ports), addresses,
                        enum_field(f, "spec.location", Location, "MESH_EXTERNAL"), resolution,  # type: ignore[arg-type]
                        endpoints, selector, export_to(f), str_list(f, "spec.subjectAltNames"))


def _labels_selector(f: _Fields) -> Labels:
    """`workloadSelector: {labels: {...}}`, as ServiceEntry and Sidecar spell it (not matchLabels)."""
    if (ws := fields(f, "spec.workloadSelector")) is not None:
        only(ws, ("labels",))
    selector = labels(f, "spec.workloadSelector.labels")
    for key, value in selector:
        if "*" in key or "*" in value:
            raise f.fail("spec.workloadSelector.labels: wildcard is not supported in selector")
    return selector


# --- Gateway, Sidecar -------------------------------------------------------------------------

def _namespaced_host(f: _Fields, path: str, text: str, gateway: bool) -> tuple[str, str]:
    """`namespace/dnsName` (a Gateway may leave out the namespace: `*/` is meant)."""
    ns, slash, name = text.partition("/")
    if not slash:
        if not gateway:
            raise f.fail(f"{path}: host must be of form namespace/dnsName")
        ns, name = "*", text
    if not ns or not name:
        raise f.fail(f"{path}: config namespace and dnsName in host entry cannot be empty")
    allowed = ("*", ".") if gateway else ("*", ".", "~")
    if ns not in allowed and not dns1123_label(ns):
        raise f.fail(f"{path}: invalid namespace value {ns!r} in {'gateway' if gateway else 'sidecar'}")
    if name != "*":
        raise_if(f, wildcard_domain_error(name), path)
    return ns, name


def _server_tls(f: _Fields, path: str) -> ServerTLS | None:
    sub = fields(f, path)
    if sub is None:
        return None
    only(sub, ("httpsRedirect", "mode", "serverCertificate", "privateKey", "caCertificates", "credentialName",
               "subjectAltNames", "minProtocolVersion", "maxProtocolVersion", "cipherSuites", "credentialNames",
               "verifyCertificateSpki", "verifyCertificateHash", "caCrl", "tlsCertificates"),
         ("caCertCredentialName", "insecureSkipVerify"))
    tls = ServerTLS(enum_field(sub, "mode", ServerTLSMode, "PASSTHROUGH"), sub.get("httpsRedirect", bool, False),  # type: ignore[arg-type]
                    sub.get("serverCertificate", str, ""), sub.get("privateKey", str, ""),
                    sub.get("caCertificates", str, ""), sub.get("credentialName", str, ""),
                    str_list(sub, "subjectAltNames"), sub.get("minProtocolVersion", str, ""),
                    sub.get("maxProtocolVersion", str, ""), str_list(sub, "cipherSuites"),
                    str_list(sub, "credentialNames"), str_list(sub, "verifyCertificateSpki"),
                    str_list(sub, "verifyCertificateHash"), ca_crl=sub.get("caCrl", str, ""),
                    tls_certificates=_tls_certificates(sub))
    _client_pins(f, path, tls)
    if tls.ca_crl:
        # istiod: the CRL of a credential is its Secret's ca.crl; with the mesh certificate or files, a file Envoy reads.
        if tls.credential_name:
            raise f.fail(f"{path}.caCrl: CRL is not supported with credentialName. CRL has to be specified in the credential")
        if tls.mode is ServerTLSMode.SIMPLE:
            raise f.fail(f"{path}.caCrl: CRL is not supported with SIMPLE TLS")
        if tls.credential_names:
            raise f.fail(f"{path}.caCrl: caCrl is not supported by this istiod with credentialNames "
                         "(a credential's CRL is the ca.crl of its Secret)")
        if tls.mode in (ServerTLSMode.PASSTHROUGH, ServerTLSMode.AUTO_PASSTHROUGH):  # istiod warns and ignores it
            raise f.fail(f"{path}.caCrl: {tls.mode.value} mode does not use certificates")
    if sum((bool(tls.server_certificate and tls.private_key), bool(tls.credential_name), bool(tls.credential_names),
            bool(tls.tls_certificates))) > 1:
        raise f.fail(f"{path}: only one of credential_name, credential_names, server_certificate/private_key, "
                     "tls_certificates should be specified")
    for name, version in (("minProtocolVersion", tls.min_protocol_version), ("maxProtocolVersion", tls.max_protocol_version)):
        if version not in ("", "TLS_AUTO", *TLS_PROTOCOL_VERSIONS):
            raise f.fail(f"{path}.{name}: {version!r} is not one of TLS_AUTO, {', '.join(TLS_PROTOCOL_VERSIONS)}")
    if (tls.min_protocol_version in TLS_PROTOCOL_VERSIONS and tls.max_protocol_version in TLS_PROTOCOL_VERSIONS
            and TLS_PROTOCOL_VERSIONS.index(tls.min_protocol_version) > TLS_PROTOCOL_VERSIONS.index(tls.max_protocol_version)):
        raise f.fail(f"{path}: minProtocolVersion is higher than maxProtocolVersion")
    if tls.mode is ServerTLSMode.ISTIO_MUTUAL:
        for present, what in ((tls.server_certificate, "server certificate"), (tls.private_key, "private key"),
                              (tls.ca_certificates, "CA bundle"), (tls.tls_certificates, "tlsCertificates"),
                              (tls.credential_name, "credentialName"), (tls.credential_names, "credentialNames")):
            if present:
                raise f.fail(f"{path}: ISTIO_MUTUAL TLS cannot have associated {what}")
    elif tls.mode in (ServerTLSMode.SIMPLE, ServerTLSMode.MUTUAL, ServerTLSMode.OPTIONAL_MUTUAL) and not tls.credentials:
        prefix = "SIMPLE TLS" if tls.mode is ServerTLSMode.SIMPLE else "MUTUAL TLS"
        if tls.mode is not ServerTLSMode.SIMPLE and not tls.ca_certificates:
            raise f.fail(f"{path}: {prefix} requires a client CA bundle")
        for certificate, key in tls.tls_certificates or ((tls.server_certificate, tls.private_key),):
            if not certificate:
                raise f.fail(f"{path}: {prefix} requires a server certificate")
            if not key:
                raise f.fail(f"{path}: {prefix} requires a private key")
    return tls


def _tls_certificates(f: _Fields) -> tuple[tuple[str, str], ...]:
    """tlsCertificates: each a serverCertificate and privateKey file in the proxy."""
    pairs = []
    for item in items(f, "tlsCertificates"):
        only(item, ("serverCertificate", "privateKey"))
        pairs.append((item.get("serverCertificate", str, ""), item.get("privateKey", str, "")))
    return tuple(pairs)


def _client_pins(f: _Fields, path: str, tls: ServerTLS) -> None:
    """verifyCertificateSpki (base64 of a SHA-256) and verifyCertificateHash (hex of a SHA-256, `:` allowed),
    as Envoy takes them: a malformed one would have Envoy reject the whole listener."""
    for i, pin in enumerate(tls.verify_certificate_spki):
        try:
            ok = len(base64.b64decode(pin, validate=True)) == 32
        except ValueError:
            ok = False
        if not ok:
            raise f.fail(f"{path}.verifyCertificateSpki[{i}]: {pin!r} is not the base64 of a SHA-256 digest")
    for i, pin in enumerate(tls.verify_certificate_hash):
        if not re.fullmatch(r"[0-9a-fA-F]{64}", pin.replace(":", "")):
            raise f.fail(f"{path}.verifyCertificateHash[{i}]: {pin!r} is not the hex of a SHA-256 digest")


def gateway(key: ObjectKey, f: _Fields, domain: str) -> Gateway:
    spec(f, ("servers", "selector"))
    servers: list[Server] = []
    for i, s in enumerate(items(f, "spec.servers")):
        where = f"spec.servers[{i}]"
        if "defaultEndpoint" in s.body:  # Istio's API marks it NOT IMPLEMENTED: istiod ignores it
            raise f.fail(f"{where}.defaultEndpoint: defaultEndpoint of a Gateway server is not implemented by istiod")
        only(s, ("port", "bind", "hosts", "tls", "name"))
        server_port = _service_port(_required(s, "port"))
        if not server_port.name:
            raise f.fail(f"{where}.port.name: port name must be set")
        if any(o.port.name == server_port.name for o in servers):
            raise f.fail(f"{where}.port.name: port names in servers must be unique: duplicate name {server_port.name}")
        hosts = str_list(s, "hosts")
        if not hosts:
            raise f.fail(f"{where}.hosts: server config must contain at least one host")
        bind = s.get("bind", str, "")
        if bind and not is_ip(bind):
            raise f.fail(f"{where}.bind: {bind!r} is not an IP address")
        tls = _server_tls(s, "tls")
        secure = server_port.protocol in ("HTTPS", "TLS")
        if secure and tls is None:
            raise f.fail(f"{where}.tls: server must have TLS settings for HTTPS/TLS protocols")
        if not secure and tls is not None and (tls.mode is not ServerTLSMode.PASSTHROUGH or tls.server_certificate
                                               or tls.private_key or tls.ca_certificates or tls.tls_certificates):
            raise f.fail(f"{where}.tls: server cannot have TLS settings for plain text HTTP ports")
        servers.append(Server(server_port, tuple(_namespaced_host(f, f"{where}.hosts[{j}]", h, True)
                                                 for j, h in enumerate(hosts)), bind, tls, s.get("name", str, "")))
    if not servers:
        raise f.fail("spec.servers: gateway must have at least one server")
    return Gateway(meta(key), tuple(servers), labels(f, "spec.selector"))


_CAPTURE_MODES = ("DEFAULT", "IPTABLES", "NONE")


def _capture_mode(f: _Fields, path: str) -> str:
    mode = f.get(path, str, "DEFAULT")
    if mode not in _CAPTURE_MODES:
        raise f.fail(f"{path}: {mode!r} is not one of {', '.join(_CAPTURE_MODES)}")
    return mode


def sidecar(key: ObjectKey, f: _Fields, domain: str) -> Sidecar:
    body = spec(f, ("workloadSelector", "ingress", "egress", "outboundTrafficPolicy", "inboundConnectionPool")).body
    selector = _labels_selector(f)
    if "workloadSelector" in body and not selector:
        raise f.fail("spec.workloadSelector: sidecar: workloadSelector cannot have empty labels")
    if not any(body.get(k) for k in ("ingress", "egress", "outboundTrafficPolicy", "inboundConnectionPool")):
        raise f.fail("spec: sidecar: empty configuration provided")
    ingress: list[IngressListener] = []
    for i, item in enumerate(items(f, "spec.ingress")):
        where = f"spec.ingress[{i}]"
        only(item, ("port", "bind", "defaultEndpoint", "captureMode", "connectionPool", "tls"))
        listener_port = _service_port(_required(item, "port"), sniffed=True)  # no protocol: sniffed, as istiod
        if listener_port.target_port:
            raise f.fail(f"{where}.port.targetPort: targetPort has no impact on Sidecars")
        if any(o.port.number == listener_port.number for o in ingress):
            raise f.fail(f"{where}.port: sidecar: ports on IP bound listeners must be unique")
        bind = item.get("bind", str, "")
        if bind and not is_ip(bind):
            raise f.fail(f"{where}.bind: sidecar: {bind!r} is not a valid IP address")
        endpoint = _default_endpoint(f, f"{where}.defaultEndpoint", item.get("defaultEndpoint", str, ""))
        ingress.append(IngressListener(listener_port, bind, endpoint, _capture_mode(item, "captureMode"),
                                       _connection_pool(item, "connectionPool"),
                                       _ingress_tls(f, item, where, listener_port.protocol)))
    egress: list[EgressListener] = []
    listeners = items(f, "spec.egress")
    for i, item in enumerate(listeners):
        where = f"spec.egress[{i}]"
        only(item, ("port", "bind", "captureMode", "hosts"))
        egress_port = _service_port(_required(item, "port")) if "port" in item.body else None
        if egress_port is None and i != len(listeners) - 1:
            raise f.fail(f"{where}: sidecar: the egress listener with empty port should be the last listener in the list")
        if egress_port is not None and any(o.port and o.port.number == egress_port.number for o in egress):
            raise f.fail(f"{where}.port: sidecar: ports on IP bound listeners must be unique")
        hosts = str_list(item, "hosts")
        if not hosts:
            raise f.fail(f"{where}.hosts: sidecar: egress listener must contain at least one host")
        bind = item.get("bind", str, "")
        if bind.startswith("unix://"):
            raise f.fail(f"{where}.bind: unix domain socket listeners are not supported by this istiod")
        if bind and not is_ip(bind):
            raise f.fail(f"{where}.bind: sidecar: {bind!r} is not a valid IP address")
        if egress_port is None and (bind or item.get("captureMode", str, "DEFAULT") == "NONE"):
            raise f.fail(f"{where}: bind and captureMode NONE on the egress listener without a port "
                         "are not supported by this istiod")
        egress.append(EgressListener(tuple(_namespaced_host(f, f"{where}.hosts[{j}]", h, False)
                                           for j, h in enumerate(hosts)),
                                     egress_port, bind, _capture_mode(item, "captureMode")))
    mode, egress_proxy = "", None
    if (policy := fields(f, "spec.outboundTrafficPolicy")) is not None:
        only(policy, ("mode", "egressProxy"))
        mode = policy.get("mode", str, "REGISTRY_ONLY")
        if mode not in ("ALLOW_ANY", "REGISTRY_ONLY"):
            raise f.fail(f"spec.outboundTrafficPolicy.mode: {mode!r} is not one of ALLOW_ANY, REGISTRY_ONLY")
        if "egressProxy" in policy.body:
            where = "spec.outboundTrafficPolicy.egressProxy"
            if mode != "ALLOW_ANY":
                raise f.fail(f"{where}: sidecar: egress_proxy must be set only with ALLOW_ANY outbound_traffic_policy mode")
            egress_proxy = _destination(f, where, key.namespace, domain)
            if not egress_proxy.port:
                raise f.fail(f"{where}.port: sidecar: egress_proxy port must be non-nil")
    return Sidecar(meta(key), tuple(egress), tuple(ingress), selector, mode,
                   _connection_pool(f, "spec.inboundConnectionPool"), egress_proxy)


def _default_endpoint(f: _Fields, path: str, endpoint: str) -> str:
    """istiod's forms: 127.0.0.1:<port> and [::1]:<port> (loopback), 0.0.0.0:<port> and [::]:<port>
    (the pod's address), or unset; Unix sockets are not implemented."""
    if not endpoint:
        return ""
    if endpoint.startswith("unix://"):
        raise f.fail(f"{path}: unix domain socket endpoints are not supported by this istiod")
    host, colon, number = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # Go's SplitHostPort: an IPv6 host needs its brackets
        raise f.fail(f"{path}: address {endpoint}: too many colons in address")
    if not colon:
        raise f.fail(f"{path}: address {endpoint}: missing port in address")
    if host not in ("127.0.0.1", "0.0.0.0", "::1", "::"):
        raise f.fail(f"{path}: sidecar: defaultEndpoint must be of form "
                     "127.0.0.1:<port>,0.0.0.0:<port>,[::1]:port,[::]:port,unix://filepath or unset")
    if not number.isdigit():
        raise f.fail(f"{path}: sidecar: defaultEndpoint port ({number}) is not a number")
    if not 0 < int(number) < 65536:
        raise f.fail(f"{path}: port number {int(number)} must be in the range 1..65535")
    return endpoint


def _ingress_tls(f: _Fields, item: _Fields, where: str, port_protocol: str) -> ServerTLS | None:
    """istiod's rules for a Sidecar ingress listener's TLS: SIMPLE, MUTUAL or OPTIONAL_MUTUAL with
    files in the proxy, on HTTPS or TLS ports."""
    tls = _server_tls(item, "tls")
    if tls is None:
        return None
    path = f"{where}.tls"
    if tls.subject_alt_names:
        raise f.fail(f"{path}.subjectAltNames: sidecar: subjectAltNames is not supported in ingress tls")
    if tls.https_redirect:
        raise f.fail(f"{path}.httpsRedirect: sidecar: httpsRedirect is not supported")
    if tls.credential_name:
        raise f.fail(f"{path}.credentialName: sidecar: credentialName is not currently supported")
    if tls.credential_names:
        raise f.fail(f"{path}.credentialNames: sidecar: credentialNames is not currently supported")
    if tls.tls_certificates:
        raise f.fail(f"{path}.tlsCertificates: sidecar: tls_certificates is not currently supported")
    if tls.verify_certificate_spki or tls.verify_certificate_hash:  # istiod applies them to credentials only
        raise f.fail(f"{path}: sidecar: verifyCertificateSpki/verifyCertificateHash are not supported in ingress tls "
                     "by this istiod (istiod ignores them without a credentialName)")
    if tls.mode in (ServerTLSMode.ISTIO_MUTUAL, ServerTLSMode.AUTO_PASSTHROUGH):
        raise f.fail(f"{path}.mode: configuration is invalid: cannot set mode to {tls.mode.value} in sidecar ingress tls")
    if tls.mode is ServerTLSMode.PASSTHROUGH:  # istiod builds a TLS context without certificates
        raise f.fail(f"{path}.mode: PASSTHROUGH in sidecar ingress tls is not supported by this istiod")
    if parse_protocol(port_protocol) not in (Protocol.HTTPS, Protocol.TLS):
        raise f.fail(f"{path}: server cannot have TLS settings for non HTTPS/TLS ports")
    return tls

"""VirtualService HTTP routes -> Envoy/gRPC routes, as istiod's route translation. Pure; shared by
every flavor. What differs per flavor is passed in: how a timeout is spelled (gRPC reads only
`max_stream_duration`), that gRPC gets no header operations or rewrites (it ignores them), and
the DestinationRule lookup that gives a destination's hash policy.

One route per (http route, match), in order; no match means every request. Without a
VirtualService a host gets istiod's default route: prefix `/`, no timeout, the default retries.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.filters.common.fault.v3 import fault_pb2 as common_fault_pb2
from envoy.extensions.filters.http.cors.v3 import cors_pb2
from envoy.extensions.filters.http.fault.v3 import fault_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, string_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import duration_pb2, wrappers_pb2

from istiod.model.config.common import MatchKind, StringMatch, selector_matches
from istiod.model.config.networking import (
    MESH_GATEWAY, ConsistentHash, CorsPolicy, Destination, DirectResponse, Fault, Headers, HTTPMatch, HTTPRoute, L4Match, L4Route,
    Mirror, Redirect, Retries, VirtualService, routing_claim,
)
from istiod.model.names import outbound_cluster_name
from istiod.model.service import Service
from istiod.xds.gen.authn import payload_matcher, string_or_list
from istiod.xds.gen.filters import CORS_FILTER, FAULT_FILTER, pack
from istiod.xds.gen.policy import duration, hash_policies

PREVIOUS_HOSTS = "envoy.retry_host_predicates.previous_hosts"
PREVIOUS_PRIORITIES = "envoy.retry_priorities.previous_priorities"
DEFAULT_RETRY_ON = "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes"
# gRPC status codes by the names Istio's API uses (grpcStatus, retryOn).
GRPC_CODES = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9,
    "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14,
    "DATA_LOSS": 15, "UNAUTHENTICATED": 16,
}
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_APPEND = base_pb2.HeaderValueOption.APPEND_IF_EXISTS_OR_ADD
_REDIRECT_CODES = {
    301: rc.RedirectAction.MOVED_PERMANENTLY, 302: rc.RedirectAction.FOUND, 303: rc.RedirectAction.SEE_OTHER,
    307: rc.RedirectAction.TEMPORARY_REDIRECT, 308: rc.RedirectAction.PERMANENT_REDIRECT,
}

# (host, subset, port) -> the consistentHash of the DestinationRule that applies, if any.
HashLookup = Callable[[str, str, int], ConsistentHash | None]


def http_routes(vs: VirtualService | None, service: Service, port: int, services: Mapping[str, Service],
                hash_for: HashLookup, proxyless: bool, source: tuple[str, Mapping[str, str]]) -> list[rc.Route]:
    """The routes of the virtual host for `service:port`, as a mesh proxy with `source`
    (namespace, labels) sees them: matches for other ports, sources or gateways are left out."""
    if vs is None or not vs.http:
        default = default_route("default", service.cluster_name(port), proxyless)
        default.route.hash_policy.extend(hash_policies(hash_for(service.hostname, "", port)))
        return [default]
    return virtual_service_routes(vs, port, services, hash_for, proxyless, source, (MESH_GATEWAY,))


def virtual_service_routes(vs: VirtualService, port: int, services: Mapping[str, Service], hash_for: HashLookup,
                           proxyless: bool, source: tuple[str, Mapping[str, str]],
                           gateways: Collection[str]) -> list[rc.Route]:
    """A VirtualService's routes for a proxy on `gateways` (`mesh` for sidecars and gRPC, the
    `<ns>/<name>` of its Gateways for a gateway): a match naming other gateways is left out."""
    routes = []
    for http in vs.http:
        template = _route(http, port, services, hash_for, proxyless)
        matches = [m for m in http.match if _applies(m, port, *source, gateways)] if http.match else [HTTPMatch()]
        if proxyless:  # gRPC verifies no JWT: a match on a claim is left out rather than misread
            matches = [m for m in matches if not any(routing_claim(n) for n, _ in (*m.headers, *m.without_headers))]
        for match in matches:
            route = rc.Route()
            route.CopyFrom(template)
            route.name = ".".join(n for n in (http.name, match.name) if n)
            route.stat_prefix = match.stat_prefix
            route.match.CopyFrom(_match(match, vs.gateway_semantics))
            routes.append(route)
    return routes


def _route(http: HTTPRoute, port: int, services: Mapping[str, Service], hash_for: HashLookup,
           proxyless: bool) -> rc.Route:
    """Everything of one http route but its name and match, as istiod's translateRoute. gRPC
    ignores header operations, rewrites and mirrors, and NACKs the CORS filter's config (istiod sends
    them anyway): proxyless routes leave them out."""
    route = rc.Route()
    if not proxyless:
        _add_header_operations(route, http.headers)
    if http.redirect is not None:
        route.redirect.CopyFrom(_redirect(http.redirect, port))
    elif http.direct_response is not None:
        route.direct_response.CopyFrom(_direct_response(http.direct_response))
    else:
        _forward(route, http, port, services, hash_for, proxyless)
    if http.fault is not None:
        route.typed_per_filter_config[FAULT_FILTER].CopyFrom(pack(_fault(http.fault)))
    if http.cors_policy is not None and not proxyless:
        route.typed_per_filter_config[CORS_FILTER].CopyFrom(pack(_cors(http.cors_policy)))
    return route


def _forward(route: rc.Route, http: HTTPRoute, port: int, services: Mapping[str, Service], hash_for: HashLookup,
             proxyless: bool) -> None:
    """The route action, as istiod's applyHTTPRouteDestination. The host rewrite: `rewrite.authority`,
    else the route's request headers', else a single destination's; a weighted destination's
    header operations and authority stay with its cluster."""
    action = route.route
    destinations = [d for d in http.route if d.weight > 0 or len(http.route) == 1]
    clusters = []
    for dest in destinations:
        name, dest_port = destination_cluster(dest.destination, port, services)
        clusters.append((name, dest.weight, (dest.destination.host, dest.destination.subset, dest_port)))
    authority = (http.rewrite.authority if http.rewrite is not None else "") or _authority(http.headers)
    if len(clusters) == 1:
        action.cluster = clusters[0][0]
        action.hash_policy.extend(hash_policies(hash_for(*clusters[0][2])))
        if not proxyless:
            _add_header_operations(route, destinations[0].headers)
            authority = authority or _authority(destinations[0].headers)
    else:
        for (name, weight, _), dest in zip(clusters, destinations):
            cluster = action.weighted_clusters.clusters.add(name=name, weight=wrappers_pb2.UInt32Value(value=weight))
            if not proxyless:
                _add_header_operations(cluster, dest.headers)
                if dest_authority := _authority(dest.headers):
                    cluster.host_rewrite_literal = dest_authority
    if not proxyless:
        if authority:
            action.host_rewrite_literal = authority
        rewrite = http.rewrite
        if rewrite is not None and rewrite.uri_regex is not None:
            action.regex_rewrite.CopyFrom(regex_pb2.RegexMatchAndSubstitute(
                pattern=_regex(rewrite.uri_regex[0]), substitution=rewrite.uri_regex[1]))
        elif rewrite is not None and rewrite.uri:
            action.prefix_rewrite = rewrite.uri
    if not proxyless:
        action.request_mirror_policies.extend(
            _mirror(m, port, services) for m in http.mirrors if m.percentage > 0)  # 0%: none, as istiod
    _set_timeout(action, http.timeout, proxyless)
    # A hashed destination keeps its retries on the same endpoint (istiod's consistent-hash policy).
    retries = retry_policy(http.retries, hashed=bool(action.hash_policy))
    if retries is not None:
        action.retry_policy.CopyFrom(retries)


def default_route(name: str, cluster: str, proxyless: bool) -> rc.Route:
    """istiod's route when no VirtualService says otherwise: every path, no timeout, default retries."""
    route = rc.Route(name=name, match=rc.RouteMatch(prefix="/"),
                     route=rc.RouteAction(cluster=cluster, retry_policy=default_retries()))
    _set_timeout(route.route, None, proxyless)
    return route


def _add_header_operations(target: rc.Route | rc.WeightedCluster.ClusterWeight, headers: Headers) -> None:
    """istiod's TranslateHeadersOperations: `set` overwrites, `add` appends, each sorted by name;
    the authority is a host rewrite, not a header."""
    for operations, to_add, to_remove in (
        (headers.request, target.request_headers_to_add, target.request_headers_to_remove),
        (headers.response, target.response_headers_to_add, target.response_headers_to_remove),
    ):
        for values, append in ((operations.set, _OVERWRITE), (operations.add, _APPEND)):
            to_add.extend(base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, value=v), append_action=append)
                          for k, v in values if not _is_authority(k))
        to_remove.extend(operations.remove)


def _authority(headers: Headers) -> str:
    """The authority a destination's or route's request headers set (`set` over `add`)."""
    request = headers.request
    return next((v for k, v in (*request.set, *request.add) if _is_authority(k)), "")


def _is_authority(name: str) -> bool:
    return name.lower() in (":authority", "host")


def _redirect(redirect: Redirect, port: int) -> rc.RedirectAction:
    """istiod's ApplyRedirect; FROM_REQUEST_PORT is the listener's port (routes are per port), and
    a scheme's default port is left out."""
    action = rc.RedirectAction(host_redirect=redirect.authority, path_redirect=redirect.uri,
                               response_code=_REDIRECT_CODES[redirect.code])
    if redirect.scheme:
        action.scheme_redirect = redirect.scheme
    if redirect.prefix_rewrite:
        action.prefix_rewrite = redirect.prefix_rewrite
    redirect_port = port if redirect.derive_port == "FROM_REQUEST_PORT" else redirect.port
    if (redirect_port, redirect.scheme or "http") not in ((80, "http"), (443, "https")):
        action.port_redirect = redirect_port
    return action


def _direct_response(response: DirectResponse) -> rc.DirectResponseAction:
    action = rc.DirectResponseAction(status=response.status)
    if isinstance(response.body, str):
        action.body.inline_string = response.body
    elif isinstance(response.body, bytes):
        action.body.inline_bytes = response.body
    return action


def destination_cluster(destination: Destination, port: int, services: Mapping[str, Service]) -> tuple[str, int]:
    """The cluster of a route's destination, and its port: as written, else the service's only
    port, else the port the traffic came in on."""
    target = services.get(destination.host)
    dest_port = destination.port or (target.ports[0].port if target is not None and len(target.ports) == 1 else port)
    return outbound_cluster_name(dest_port, destination.host, destination.subset), dest_port


# Where an L4 route sends: (cluster, weight) pairs; a weight of 0 with one destination means all.
L4Destinations = list[tuple[str, int]]


def tcp_destinations(vs: VirtualService | None, service: Service, port: int, services: Mapping[str, Service],
                     source: tuple[str, Mapping[str, str]], vip: str | None) -> L4Destinations:
    """For TCP traffic to `service:port` (at `vip`) from a mesh proxy with `source` (namespace,
    labels): the first `tcp` route with a match that holds (or none), else the service's own
    cluster. Every match condition is fixed per listener and proxy, so it is decided here rather
    than by Envoy."""
    for tcp in vs.tcp if vs is not None else ():
        if not tcp.match or any(_l4_applies(m, port, vip, *source) for m in tcp.match):
            return _l4_destinations(tcp, port, services)
    return [(service.cluster_name(port), 0)]


def tls_destinations(vs: VirtualService | None, port: int, services: Mapping[str, Service],
                     source: tuple[str, Mapping[str, str]], vip: str | None) -> list[tuple[tuple[str, ...], L4Destinations]]:
    """(SNI names, destinations) per `tls` route whose matches hold, in order; a name belongs to
    the first route that names it (Envoy refuses two filter chains with one match)."""
    claimed: set[str] = set()
    result = []
    for tls in vs.tls if vs is not None else ():
        names = [n for m in tls.match if _l4_applies(m, port, vip, *source) for n in m.sni_hosts if n not in claimed]
        if names:
            claimed.update(names)
            result.append((tuple(dict.fromkeys(names)), _l4_destinations(tls, port, services)))
    return result


def gateway_tcp_destinations(services_bound: Iterable[VirtualService], port: int, gateway: str,
                             services: Mapping[str, Service]) -> L4Destinations | None:
    """For a gateway's TCP server (or one terminating TLS) on `port` of `gateway` (`<ns>/<name>`):
    the first `tcp` route, of the bound VirtualServices in order, whose match holds; None if none.
    At a gateway only the port and gateway conditions count, as istiod's l4MultiMatch."""
    for vs in services_bound:
        for tcp in vs.tcp:
            if tcp.route and (not tcp.match or any(_gateway_l4_applies(m, port, gateway) for m in tcp.match)):
                return _l4_destinations(tcp, port, services)
        # A TLSRoute on a listener terminating TLS: its `tls` routes stand for `tcp` ones (istiod's fallback).
        for tls in vs.tls if vs.gateway_semantics else ():
            if tls.route and any(_gateway_l4_applies(m, port, gateway) for m in tls.match):
                return _l4_destinations(tls, port, services)
    return None


def gateway_tls_destinations(services_bound: Iterable[VirtualService], port: int, gateway: str,
                             services: Mapping[str, Service]) -> Iterator[tuple[VirtualService, tuple[str, ...], L4Destinations]]:
    """For a gateway's PASSTHROUGH server: (VirtualService, SNI names, destinations) per match of
    a `tls` route that holds, in order, as istiod's buildGatewayNetworkFiltersFromTLSRoutes."""
    for vs in services_bound:
        for tls in vs.tls:
            if tls.route:
                for m in tls.match:
                    if _gateway_l4_applies(m, port, gateway):
                        yield vs, m.sni_hosts, _l4_destinations(tls, port, services)


def _gateway_l4_applies(match: L4Match, port: int, gateway: str) -> bool:
    return (not match.port or match.port == port) and (not match.gateways or gateway in match.gateways)


def _l4_destinations(route: L4Route, port: int, services: Mapping[str, Service]) -> L4Destinations:
    chosen = [d for d in route.route if d.weight > 0 or len(route.route) == 1]
    return [(destination_cluster(d.destination, port, services)[0], d.weight) for d in chosen]


def _l4_applies(match: L4Match, port: int, vip: str | None, namespace: str, labels: Mapping[str, str]) -> bool:
    subnets = match.destination_subnets
    return ((not match.port or match.port == port)
            and (not match.gateways or MESH_GATEWAY in match.gateways)
            and (not match.source_namespace or match.source_namespace == namespace)
            and selector_matches(match.source_labels, labels)
            and (not subnets or (vip is not None and any(
                ipaddress.ip_address(vip) in ipaddress.ip_network(s, strict=False) for s in subnets))))


def _set_timeout(action: rc.RouteAction, timeout: object, proxyless: bool) -> None:
    """istiod's setTimeout: no timeout unless the route sets one. gRPC reads only max_stream_duration;
    Envoy caps a gRPC client's own deadline (grpc-timeout) at the route timeout."""
    value = duration(timeout) if timeout is not None else duration_pb2.Duration()  # type: ignore[arg-type]
    action.timeout.CopyFrom(value)
    if proxyless:
        action.max_stream_duration.max_stream_duration.CopyFrom(value)
    else:
        action.max_stream_duration.grpc_timeout_header_max.CopyFrom(value)


def default_retries(hashed: bool = False) -> rc.RetryPolicy:
    """istiod's default: twice, on another endpoint (the same one for a `hashed` destination), when
    a connection fails or is refused (an endpoint that just went away) or gRPC says
    UNAVAILABLE/CANCELLED. No status code is retriable unless retryOn names it (Istio dropped 503)."""
    policy = rc.RetryPolicy(retry_on=DEFAULT_RETRY_ON, num_retries=wrappers_pb2.UInt32Value(value=2),
                            host_selection_retry_max_attempts=5)
    if not hashed:
        _retry_elsewhere(policy)
    return policy


def _retry_elsewhere(policy: rc.RetryPolicy) -> None:
    policy.retry_host_predicate.add(name=PREVIOUS_HOSTS, typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()))


def retry_policy(retries: Retries | None, hashed: bool = False) -> rc.RetryPolicy | None:
    """istiod's retry.ConvertPolicy: none set means the default, `attempts: 0` no retries; retryOn
    entries that are HTTP status numbers become retriable status codes; retryRemoteLocalities moves
    a retry to the next priority."""
    if retries is None:
        return default_retries(hashed)
    if retries.attempts <= 0:
        return None
    policy = default_retries(hashed)
    policy.num_retries.value = retries.attempts
    if retries.retry_on:
        codes = [int(v) for v in retries.retry_on if v.isdigit()]
        names = [v for v in retries.retry_on if not v.isdigit()]
        if codes:
            names.append("retriable-status-codes")
        policy.retry_on = ",".join(dict.fromkeys(names))
        del policy.retriable_status_codes[:]
        policy.retriable_status_codes.extend(codes)
    if retries.per_try_timeout is not None:
        policy.per_try_timeout.CopyFrom(duration(retries.per_try_timeout))
    if retries.retry_ignore_previous_hosts is not None:
        del policy.retry_host_predicate[:]
        if retries.retry_ignore_previous_hosts:
            _retry_elsewhere(policy)
    if retries.retry_remote_localities:
        policy.retry_priority.name = PREVIOUS_PRIORITIES
        policy.retry_priority.typed_config.CopyFrom(pack(
            previous_priorities_config_pb2.PreviousPrioritiesConfig(update_frequency=2)))
    if retries.backoff is not None:
        policy.retry_back_off.base_interval.CopyFrom(duration(retries.backoff))
    return policy


def _applies(match: HTTPMatch, port: int, namespace: str, labels: Mapping[str, str],
             gateways: Collection[str]) -> bool:
    return ((not match.port or match.port == port)
            and (not match.gateways or any(g in match.gateways for g in gateways))
            and (not match.source_namespace or match.source_namespace == namespace)
            and selector_matches(match.source_labels, labels))


def _match(match: HTTPMatch, gateway_semantics: bool = False) -> rc.RouteMatch:
    result = rc.RouteMatch(case_sensitive=wrappers_pb2.BoolValue(value=False) if match.ignore_uri_case else None)
    uri = match.uri
    if uri is None:
        result.prefix = "/"
    elif uri.kind is MatchKind.EXACT:
        result.path = uri.value
    elif uri.kind is MatchKind.PREFIX and gateway_semantics and uri.value != "/":
        result.path_separated_prefix = uri.value.rstrip("/")
    elif uri.kind is MatchKind.PREFIX:
        result.prefix = uri.value
    else:
        result.safe_regex.CopyFrom(_regex(uri.value))
    pseudo = [(":method", match.method), (":authority", match.authority), (":scheme", match.scheme)]
    for name, value, invert in [*((n, v, False) for n, v in (*pseudo, *match.headers)),
                                *((n, v, True) for n, v in match.without_headers)]:
        if value is None:
            continue
        if (claim := routing_claim(name)) is not None:
            result.dynamic_metadata.append(_claim_matcher(claim, value, invert))
        else:
            result.headers.append(_header(name, value, invert))
    for name, value in match.query_params:
        result.query_parameters.append(rc.QueryParameterMatcher(name=name, string_match=_string(value)))
    return result


def _claim_matcher(claim: tuple[str, ...], value: StringMatch, invert: bool) -> metadata_pb2.MetadataMatcher:
    """A claim of the token jwt_authn verified (its payload in dynamic metadata), as istiod routes by
    it: a string claim, or a list claim holding the value."""
    return payload_matcher(claim, string_or_list(_string(value)), invert)


def _header(name: str, value: StringMatch, invert: bool) -> rc.HeaderMatcher:
    return rc.HeaderMatcher(name=name, string_match=_string(value), invert_match=invert)


def _string(value: StringMatch) -> string_pb2.StringMatcher:
    if value.kind is MatchKind.EXACT:
        return string_pb2.StringMatcher(exact=value.value)
    if value.kind is MatchKind.PREFIX:
        return string_pb2.StringMatcher(prefix=value.value)
    return string_pb2.StringMatcher(safe_regex=_regex(value.value))


def _regex(pattern: str) -> regex_pb2.RegexMatcher:
    return regex_pb2.RegexMatcher(regex=pattern)


def _fault(fault: Fault) -> fault_pb2.HTTPFault:
    result = fault_pb2.HTTPFault()
    if fault.delay is not None:
        result.delay.CopyFrom(common_fault_pb2.FaultDelay(
            fixed_delay=duration(fault.delay.fixed_delay), percentage=_percent(fault.delay.percentage)))
    if fault.abort is not None:
        abort = fault_pb2.FaultAbort(percentage=_percent(fault.abort.percentage))
        if fault.abort.grpc_status:
            abort.grpc_status = GRPC_CODES[fault.abort.grpc_status]
        else:
            abort.http_status = fault.abort.http_status
        result.abort.CopyFrom(abort)
    return result


def _mirror(mirror: Mirror, port: int, services: Mapping[str, Service]) -> rc.RouteAction.RequestMirrorPolicy:
    """istiod's TranslateRequestMirrorPolicy: the shadow keeps the Host (no `-shadow` suffix, istiod's
    DISABLE_SHADOW_HOST_SUFFIX default) and is never trace-sampled."""
    share = (_percent(mirror.percentage) if isinstance(mirror.percentage, float) else percent_pb2.FractionalPercent(
        numerator=mirror.percentage, denominator=percent_pb2.FractionalPercent.HUNDRED))
    return rc.RouteAction.RequestMirrorPolicy(
        cluster=destination_cluster(mirror.destination, port, services)[0],
        runtime_fraction=base_pb2.RuntimeFractionalPercent(default_value=share),
        trace_sampled=wrappers_pb2.BoolValue(value=False), disable_shadow_host_suffix_append=True)


def _cors(policy: CorsPolicy) -> cors_pb2.CorsPolicy:
    """istiod's TranslateCORSPolicy. Unmatched preflights go on to the upstream unless IGNORE."""
    return cors_pb2.CorsPolicy(
        allow_origin_string_match=[_string(o) for o in policy.allow_origins],
        allow_methods=",".join(policy.allow_methods), allow_headers=",".join(policy.allow_headers),
        expose_headers=",".join(policy.expose_headers),
        max_age=str(int(policy.max_age.total_seconds())) if policy.max_age is not None else "",
        allow_credentials=None if policy.allow_credentials is None else wrappers_pb2.BoolValue(
            value=policy.allow_credentials),
        filter_enabled=base_pb2.RuntimeFractionalPercent(default_value=percent_pb2.FractionalPercent(
            numerator=100, denominator=percent_pb2.FractionalPercent.HUNDRED)),
        forward_not_matching_preflights=wrappers_pb2.BoolValue(value=policy.unmatched_preflights != "IGNORE"),
    )


def _percent(value: float) -> percent_pb2.FractionalPercent:
    # istiod's translatePercentToFractionalPercent: per million, so 0.1% survives.
    return percent_pb2.FractionalPercent(numerator=round(value * 10000),
                                         denominator=percent_pb2.FractionalPercent.MILLION)

"""VirtualService HTTP routes -> Envoy/gRPC routes, as istiod's route translation. Pure; shared by
every flavor. What differs per flavor is passed in: how a timeout is spelled (gRPC reads only
`max_stream_duration`), and the DestinationRule lookup that gives a destination's hash policy.

One route per (http route, match), in order; no match means every request. Without a
VirtualService a host gets istiod's default route: prefix `/`, no timeout, the default retries.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.filters.common.fault.v3 import fault_pb2 as common_fault_pb2
from envoy.extensions.filters.http.fault.v3 import fault_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.type.matcher.v3 import regex_pb2, string_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import duration_pb2, wrappers_pb2

from istiod.model.config.common import MatchKind, StringMatch, selector_matches
from istiod.model.config.networking import (
    MESH_GATEWAY, ConsistentHash, Fault, HTTPMatch, HTTPRoute, Retries, VirtualService,
)
from istiod.model.names import outbound_cluster_name
from istiod.model.service import Service
from istiod.xds.gen.filters import FAULT_FILTER, pack
from istiod.xds.gen.policy import duration, hash_policies

PREVIOUS_HOSTS = "envoy.retry_host_predicates.previous_hosts"
DEFAULT_RETRY_ON = "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes"
# gRPC status codes by the names Istio's API uses (grpcStatus, retryOn).
GRPC_CODES = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9,
    "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14,
    "DATA_LOSS": 15, "UNAUTHENTICATED": 16,
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
        action = _action(http, port, services, hash_for, proxyless)
        fault = _fault(http.fault) if http.fault is not None else None
        matches = [m for m in http.match if _applies(m, port, *source, gateways)] if http.match else [HTTPMatch()]
        for match in matches:
            route = rc.Route(name=".".join(n for n in (http.name, match.name) if n), match=_match(match))
            route.route.CopyFrom(action)
            if fault is not None:
                route.typed_per_filter_config[FAULT_FILTER].CopyFrom(pack(fault))
            routes.append(route)
    return routes


def default_route(name: str, cluster: str, proxyless: bool) -> rc.Route:
    """istiod's route when no VirtualService says otherwise: every path, no timeout, default retries."""
    route = rc.Route(name=name, match=rc.RouteMatch(prefix="/"),
                     route=rc.RouteAction(cluster=cluster, retry_policy=default_retries()))
    _set_timeout(route.route, None, proxyless)
    return route


def _action(http: HTTPRoute, port: int, services: Mapping[str, Service], hash_for: HashLookup,
            proxyless: bool) -> rc.RouteAction:
    action = rc.RouteAction()
    destinations = [d for d in http.route if d.weight > 0 or len(http.route) == 1]
    clusters = []
    for dest in destinations:
        target = services.get(dest.destination.host)
        dest_port = dest.destination.port or (
            target.ports[0].port if target is not None and len(target.ports) == 1 else port)
        clusters.append((outbound_cluster_name(dest_port, dest.destination.host, dest.destination.subset),
                         dest.weight, (dest.destination.host, dest.destination.subset, dest_port)))
    if len(clusters) == 1:
        action.cluster = clusters[0][0]
        action.hash_policy.extend(hash_policies(hash_for(*clusters[0][2])))
    else:
        action.weighted_clusters.clusters.extend(
            rc.WeightedCluster.ClusterWeight(name=name, weight=wrappers_pb2.UInt32Value(value=weight))
            for name, weight, _ in clusters)
    _set_timeout(action, http.timeout, proxyless)
    retries = retry_policy(http.retries)
    if retries is not None:
        action.retry_policy.CopyFrom(retries)
    return action


def _set_timeout(action: rc.RouteAction, timeout: object, proxyless: bool) -> None:
    """istiod's setTimeout: no timeout unless the route sets one. gRPC reads only max_stream_duration;
    Envoy caps a gRPC client's own deadline (grpc-timeout) at the route timeout."""
    value = duration(timeout) if timeout is not None else duration_pb2.Duration()  # type: ignore[arg-type]
    action.timeout.CopyFrom(value)
    if proxyless:
        action.max_stream_duration.max_stream_duration.CopyFrom(value)
    else:
        action.max_stream_duration.grpc_timeout_header_max.CopyFrom(value)


def default_retries() -> rc.RetryPolicy:
    """istiod's default: twice, on another endpoint, when a connection fails or is refused (an
    endpoint that just went away) or the upstream answers 503 or UNAVAILABLE/CANCELLED."""
    return rc.RetryPolicy(
        retry_on=DEFAULT_RETRY_ON,
        num_retries=wrappers_pb2.UInt32Value(value=2),
        retry_host_predicate=[rc.RetryPolicy.RetryHostPredicate(
            name=PREVIOUS_HOSTS, typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()))],
        host_selection_retry_max_attempts=5,
        retriable_status_codes=[503],
    )


def retry_policy(retries: Retries | None) -> rc.RetryPolicy | None:
    """istiod's retry.ConvertPolicy: none set means the default, `attempts: 0` no retries; retryOn
    entries that are HTTP status numbers become retriable status codes."""
    if retries is None:
        return default_retries()
    if retries.attempts <= 0:
        return None
    policy = default_retries()
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
    return policy


def _applies(match: HTTPMatch, port: int, namespace: str, labels: Mapping[str, str],
             gateways: Collection[str]) -> bool:
    return ((not match.port or match.port == port)
            and (not match.gateways or any(g in match.gateways for g in gateways))
            and (not match.source_namespace or match.source_namespace == namespace)
            and selector_matches(match.source_labels, labels))


def _match(match: HTTPMatch) -> rc.RouteMatch:
    result = rc.RouteMatch(case_sensitive=wrappers_pb2.BoolValue(value=False) if match.ignore_uri_case else None)
    uri = match.uri
    if uri is None:
        result.prefix = "/"
    elif uri.kind is MatchKind.EXACT:
        result.path = uri.value
    elif uri.kind is MatchKind.PREFIX:
        result.prefix = uri.value
    else:
        result.safe_regex.CopyFrom(_regex(uri.value))
    pseudo = [(":method", match.method), (":authority", match.authority), (":scheme", match.scheme)]
    for name, value in [*pseudo, *match.headers]:
        if value is not None:
            result.headers.append(_header(name, value, invert=False))
    for name, value in match.without_headers:
        result.headers.append(_header(name, value, invert=True))
    for name, value in match.query_params:
        result.query_parameters.append(rc.QueryParameterMatcher(name=name, string_match=_string(value)))
    return result


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


def _percent(value: float) -> percent_pb2.FractionalPercent:
    # istiod's translatePercentToFractionalPercent: per million, so 0.1% survives.
    return percent_pb2.FractionalPercent(numerator=round(value * 10000),
                                         denominator=percent_pb2.FractionalPercent.MILLION)

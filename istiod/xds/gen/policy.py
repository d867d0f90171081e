"""DestinationRule -> Cluster settings, as istiod's cluster builder applies them. Pure; shared by
every flavor (what differs, the TLS transport socket, stays with the flavor).

The effective policy of a cluster is the rule's trafficPolicy, overridden field by field by the
subset's, then by the portLevelSettings entry for the port (the subset's own first), as istiod
merges them.
"""

from __future__ import annotations

import dataclasses

from envoy.config.cluster.v3 import cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import extension_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import duration_pb2, wrappers_pb2
from google.protobuf.message import Message

from istiod.model.config.common import Duration, selector_matches
from istiod.model.config.networking import (
    ClientTLS, ConnectionPool, ConsistentHash, DestinationRule, LoadBalancer, LocalityLbSetting, OutlierDetection,
    Subset, TLSMode, TrafficPolicy,
)
from istiod.model.service import Endpoint
from istiod.xds.gen import locality
from istiod.xds.gen.filters import pack

_LB_POLICIES = {
    LoadBalancer.UNSPECIFIED: cluster_pb2.Cluster.ROUND_ROBIN,
    LoadBalancer.ROUND_ROBIN: cluster_pb2.Cluster.ROUND_ROBIN,
    LoadBalancer.RANDOM: cluster_pb2.Cluster.RANDOM,
    LoadBalancer.PASSTHROUGH: cluster_pb2.Cluster.CLUSTER_PROVIDED,
}


def effective_policy(rule: DestinationRule | None, port: int, subset: Subset | None = None) -> TrafficPolicy:
    policy = TrafficPolicy()
    for layer in (rule.traffic_policy if rule else None, subset.traffic_policy if subset else None):
        if layer is None:
            continue
        policy = _merge(policy, layer)
        port_level = next((p for p in layer.port_level_settings if p.port == port), None)
        if port_level is not None:
            policy = _merge(policy, port_level)
    return policy


def _merge(base: TrafficPolicy, layer: object) -> TrafficPolicy:
    changes = {f: getattr(layer, f) for f in ("load_balancer", "connection_pool", "outlier_detection", "tls")
               if getattr(layer, f) is not None}
    return dataclasses.replace(base, **changes)


def subset_endpoints(endpoints: tuple[Endpoint, ...], subset: Subset | None) -> tuple[Endpoint, ...]:
    """A subset's endpoints are those whose labels its labels select."""
    if subset is None:
        return endpoints
    return tuple(e for e in endpoints if selector_matches(subset.labels, dict(e.labels)))


def upstream_mtls(tls: ClientTLS | None, mesh_mtls: bool) -> bool:
    """ISTIO_MUTUAL turns mTLS on, DISABLE off; without a TLS setting the mesh decides."""
    if tls is None:
        return mesh_mtls
    return tls.mode is TLSMode.ISTIO_MUTUAL


def apply_policy(cluster: cluster_pb2.Cluster, policy: TrafficPolicy, mesh_locality: LocalityLbSetting | None) -> None:
    """Load balancing (with the mesh's locality LB setting as the default), circuit breakers and
    outlier detection onto a cluster being built."""
    lb = policy.load_balancer
    if lb is not None and lb.consistent_hash is not None:
        cluster.lb_policy = cluster_pb2.Cluster.RING_HASH
        if lb.consistent_hash.minimum_ring_size:
            cluster.ring_hash_lb_config.minimum_ring_size.value = lb.consistent_hash.minimum_ring_size
    elif lb is not None and lb.simple in (LoadBalancer.LEAST_REQUEST, LoadBalancer.LEAST_CONN):
        # As a load_balancing_policy list: a client takes the first it knows, so gRPC C-core
        # (grpcio), which has no least-request and NACKs lb_policy LEAST_REQUEST, falls back to
        # round robin while Envoy and grpc-go/Java balance by least requests.
        cluster.load_balancing_policy.policies.extend(
            _typed_policy(name, config) for name, config in (
                ("envoy.load_balancing_policies.least_request", least_request_pb2.LeastRequest()),
                ("envoy.load_balancing_policies.round_robin", round_robin_pb2.RoundRobin())))
    elif lb is not None and lb.simple is not None:
        cluster.lb_policy = _LB_POLICIES[lb.simple]
    if policy.connection_pool is not None:
        _apply_connection_pool(cluster, policy.connection_pool)
    if policy.outlier_detection is not None:
        _apply_outlier_detection(cluster, policy.outlier_detection)
    locality.apply_to_cluster(cluster, mesh_locality, policy)


def _typed_policy(name: str, config: Message) -> cluster_pb2.LoadBalancingPolicy.Policy:
    return cluster_pb2.LoadBalancingPolicy.Policy(
        typed_extension_config=extension_pb2.TypedExtensionConfig(name=name, typed_config=pack(config)))


def _apply_connection_pool(cluster: cluster_pb2.Cluster, pool: ConnectionPool) -> None:
    # Onto the flavor's own default thresholds (Envoy sidecars lift Envoy's limits), if any.
    if not cluster.circuit_breakers.thresholds:
        cluster.circuit_breakers.thresholds.add()
    threshold = cluster.circuit_breakers.thresholds[0]
    if pool.http is not None:
        if pool.http.http2_max_requests:
            threshold.max_requests.value = pool.http.http2_max_requests
        if pool.http.http1_max_pending_requests:
            threshold.max_pending_requests.value = pool.http.http1_max_pending_requests
        if pool.http.max_retries:
            threshold.max_retries.value = pool.http.max_retries
    if pool.tcp is not None:
        if pool.tcp.max_connections:
            threshold.max_connections.value = pool.tcp.max_connections
        if pool.tcp.connect_timeout is not None:
            cluster.connect_timeout.CopyFrom(duration(pool.tcp.connect_timeout))


def _apply_outlier_detection(cluster: cluster_pb2.Cluster, outlier: OutlierDetection) -> None:
    # Success-rate ejection stays off, as istiod leaves it (gRPC would turn it on by default).
    out = outlier_detection_pb2.OutlierDetection(enforcing_success_rate=wrappers_pb2.UInt32Value(value=0))
    if outlier.consecutive_5xx_errors is not None:
        out.consecutive_5xx.value = outlier.consecutive_5xx_errors
        out.enforcing_consecutive_5xx.value = 100 if outlier.consecutive_5xx_errors else 0
    if outlier.consecutive_gateway_errors is not None:
        out.consecutive_gateway_failure.value = outlier.consecutive_gateway_errors
        out.enforcing_consecutive_gateway_failure.value = 100 if outlier.consecutive_gateway_errors else 0
    if outlier.interval is not None:
        out.interval.CopyFrom(duration(outlier.interval))
    if outlier.base_ejection_time is not None:
        out.base_ejection_time.CopyFrom(duration(outlier.base_ejection_time))
    if outlier.max_ejection_percent is not None:
        out.max_ejection_percent.value = outlier.max_ejection_percent
    if outlier.split_external_local_origin_errors:
        out.split_external_local_origin_errors = True
        if outlier.consecutive_local_origin_failures is not None:
            out.consecutive_local_origin_failure.value = outlier.consecutive_local_origin_failures
            out.enforcing_consecutive_local_origin_failure.value = 100
    cluster.outlier_detection.CopyFrom(out)
    if outlier.min_health_percent is not None:
        cluster.common_lb_config.healthy_panic_threshold.CopyFrom(
            percent_pb2.Percent(value=float(outlier.min_health_percent)))


def hash_policies(consistent_hash: ConsistentHash | None) -> list[route_components_pb2.RouteAction.HashPolicy]:
    """The route side of consistentHash (the cluster side is RING_HASH)."""
    if consistent_hash is None:
        return []
    HashPolicy = route_components_pb2.RouteAction.HashPolicy
    if consistent_hash.http_header_name:
        return [HashPolicy(header=HashPolicy.Header(header_name=consistent_hash.http_header_name))]
    if consistent_hash.use_source_ip:
        return [HashPolicy(connection_properties=HashPolicy.ConnectionProperties(source_ip=True))]
    if consistent_hash.http_query_parameter_name:
        return [HashPolicy(query_parameter=HashPolicy.QueryParameter(name=consistent_hash.http_query_parameter_name))]
    if consistent_hash.http_cookie is not None:
        name, path, ttl = consistent_hash.http_cookie
        return [HashPolicy(cookie=HashPolicy.Cookie(name=name, path=path, ttl=None if ttl is None else duration(ttl)))]
    return []


def duration(value: Duration) -> duration_pb2.Duration:
    result = duration_pb2.Duration()
    result.FromTimedelta(value)
    return result

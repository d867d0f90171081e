"""DestinationRule -> Cluster settings, as istiod's cluster builder applies them. Pure; shared by
every flavor (what differs, the TLS transport socket, stays with the flavor).

The effective policy of a cluster is the rule's trafficPolicy, overridden field by field by the
subset's, as istiod merges them (MergeSubsetTrafficPolicy); a portLevelSettings entry for the port
replaces the policy it is in wholesale, as istiod's GetPortLevelTrafficPolicy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import base_pb2, extension_pb2
from envoy.config.core.v3 import proxy_protocol_pb2 as proxy_protocol_config_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.load_balancing_policies.common.v3 import common_pb2 as slow_start_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from envoy.extensions.transport_sockets.proxy_protocol.v3 import upstream_proxy_protocol_pb2 as proxy_protocol_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2 as http_options_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import duration_pb2, wrappers_pb2
from google.protobuf.message import Message

from istiod.model.config.common import Duration, selector_matches
from istiod.model.config.networking import (
    ClientTLS, ConnectionPool, ConsistentHash, DestinationRule, H2UpgradePolicy, HashAlgorithm, LoadBalancer,
    LocalityLbSetting, OutlierDetection, RetryBudget, Subset, TLSMode, TrafficPolicy, Warmup,
)
from istiod.model.service import Endpoint
from istiod.xds.gen import locality
from istiod.xds.gen.filters import pack

PROXY_PROTOCOL_TRANSPORT_SOCKET = "envoy.transport_sockets.upstream_proxy_protocol"
_LB_POLICIES = {
    LoadBalancer.UNSPECIFIED: cluster_pb2.Cluster.ROUND_ROBIN,
    LoadBalancer.ROUND_ROBIN: cluster_pb2.Cluster.ROUND_ROBIN,
    LoadBalancer.RANDOM: cluster_pb2.Cluster.RANDOM,
    LoadBalancer.PASSTHROUGH: cluster_pb2.Cluster.CLUSTER_PROVIDED,
}


def effective_policy(rule: DestinationRule | None, port: int, subset: Subset | None = None) -> TrafficPolicy:
    base, _ = _at_port(rule.traffic_policy if rule else None, port)
    layer, port_level = _at_port(subset.traffic_policy if subset else None, port)
    if layer is None:
        return base or TrafficPolicy()
    if base is None:
        return layer
    # The subset's fields win; its port-level entry replaces all four, unset ones included.
    changes: dict[str, Any] = {f: getattr(layer, f) for f in _PARTS if getattr(layer, f) is not None or port_level}
    for whole in ("proxy_protocol", "retry_budget"):  # never port-level: a subset's own wins (istiod's merge)
        if getattr(layer, whole) is not None:
            changes[whole] = getattr(layer, whole)
    return dataclasses.replace(base, **changes)


_PARTS = ("load_balancer", "connection_pool", "outlier_detection", "tls")


def _at_port(policy: TrafficPolicy | None, port: int) -> tuple[TrafficPolicy | None, bool]:
    """istiod's GetPortLevelTrafficPolicy: a portLevelSettings entry for the port replaces the
    policy wholesale (what it leaves out is the default, not inherited; PROXY protocol too)."""
    entry = next((p for p in policy.port_level_settings if p.port == port), None) if policy is not None else None
    if entry is None:
        return policy, False
    return TrafficPolicy(entry.load_balancer, entry.connection_pool, entry.outlier_detection, entry.tls), True


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
    slow_start = _slow_start(lb.warmup, lb.warmup_window_only) if lb is not None and lb.warmup else None
    if lb is not None and lb.consistent_hash is not None:
        _apply_consistent_hash(cluster, lb.consistent_hash)
    elif lb is not None and lb.simple in (LoadBalancer.LEAST_REQUEST, LoadBalancer.LEAST_CONN):
        # As a load_balancing_policy list: a client takes the first it knows, so gRPC C-core
        # (grpcio), which has no least-request and NACKs lb_policy LEAST_REQUEST, falls back to
        # round robin while Envoy and grpc-go/Java balance by least requests.
        cluster.load_balancing_policy.policies.extend(
            _typed_policy(name, config) for name, config in (
                ("envoy.load_balancing_policies.least_request", least_request_pb2.LeastRequest(
                    slow_start_config=slow_start)),
                ("envoy.load_balancing_policies.round_robin", round_robin_pb2.RoundRobin(
                    slow_start_config=slow_start))))
    elif lb is not None and lb.simple is not None:
        cluster.lb_policy = _LB_POLICIES[lb.simple]
    if slow_start is not None and not cluster.HasField("load_balancing_policy"):
        # Istio's warmup: on ROUND_ROBIN and LEAST_REQUEST only (an unset `simple` is the
        # flavor's default), the others have no slow start.
        if cluster.lb_policy == cluster_pb2.Cluster.ROUND_ROBIN:
            cluster.round_robin_lb_config.slow_start_config.CopyFrom(_cluster_slow_start(slow_start))
        elif cluster.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST:
            cluster.least_request_lb_config.slow_start_config.CopyFrom(_cluster_slow_start(slow_start))
    if policy.retry_budget is not None:
        _apply_retry_budget(cluster, policy.retry_budget)
    if policy.connection_pool is not None:
        _apply_connection_pool(cluster, policy.connection_pool)
    if policy.outlier_detection is not None:
        _apply_outlier_detection(cluster, policy.outlier_detection)
    locality.apply_to_cluster(cluster, mesh_locality, policy)


def _apply_consistent_hash(cluster: cluster_pb2.Cluster, consistent: ConsistentHash) -> None:
    """Istio's ApplyRingHashLoadBalancer: maglev or ring hash with their sizes; the old form is a
    ring of at least `minimumRingSize` (Envoy's 1024 when unset), always written out."""
    if consistent.algorithm is HashAlgorithm.MAGLEV:
        cluster.lb_policy = cluster_pb2.Cluster.MAGLEV
        if consistent.table_size:
            cluster.maglev_lb_config.table_size.value = consistent.table_size
        return
    cluster.lb_policy = cluster_pb2.Cluster.RING_HASH
    if consistent.algorithm is HashAlgorithm.RING_HASH:
        if consistent.table_size:
            cluster.ring_hash_lb_config.minimum_ring_size.value = consistent.table_size
    else:
        cluster.ring_hash_lb_config.minimum_ring_size.value = consistent.minimum_ring_size or 1024


def _slow_start(warmup: Warmup, window_only: bool) -> slow_start_pb2.SlowStartConfig:
    """Istio's setWarmup: aggression 1 (linear) and 10% unless set, with its runtime key `(`;
    the deprecated warmupDurationSecs sets the window alone."""
    config = slow_start_pb2.SlowStartConfig(slow_start_window=duration(warmup.duration))
    if not window_only:
        config.aggression.CopyFrom(base_pb2.RuntimeDouble(default_value=warmup.aggression, runtime_key="("))
        config.min_weight_percent.value = warmup.minimum_percent
    return config


def _cluster_slow_start(config: slow_start_pb2.SlowStartConfig) -> cluster_pb2.Cluster.SlowStartConfig:
    result = cluster_pb2.Cluster.SlowStartConfig()
    result.ParseFromString(config.SerializeToString())  # the same message in two packages
    return result


def _typed_policy(name: str, config: Message) -> cluster_pb2.LoadBalancingPolicy.Policy:
    return cluster_pb2.LoadBalancingPolicy.Policy(
        typed_extension_config=extension_pb2.TypedExtensionConfig(name=name, typed_config=pack(config)))


def _threshold(cluster: cluster_pb2.Cluster) -> circuit_breaker_pb2.CircuitBreakers.Thresholds:
    """The flavor's own default thresholds (Envoy sidecars lift Envoy's limits), made if it has none."""
    if not cluster.circuit_breakers.thresholds:
        cluster.circuit_breakers.thresholds.add()
    return cluster.circuit_breakers.thresholds[0]


# RetryBudget.budget_interval (Envoy 1.40's field 3, a Duration) is newer than xds-protos' copy of the
# API: written as the field's bytes, which protobuf keeps and sends as they are.
_BUDGET_INTERVAL_TAG = bytes([3 << 3 | 2])


def _apply_retry_budget(cluster: cluster_pb2.Cluster, budget: RetryBudget) -> None:
    """istiod's applyRetryBudget: 20% and at least 3 retries at once unless set."""
    retry_budget = _threshold(cluster).retry_budget
    retry_budget.budget_percent.value = 20.0 if budget.percent is None else budget.percent
    retry_budget.min_retry_concurrency.value = budget.min_retry_concurrency or 3
    if budget.interval is not None:
        interval = duration(budget.interval).SerializeToString()
        retry_budget.MergeFromString(_BUDGET_INTERVAL_TAG + bytes([len(interval)]) + interval)  # (< 128 bytes)


def _apply_connection_pool(cluster: cluster_pb2.Cluster, pool: ConnectionPool) -> None:
    threshold = _threshold(cluster)
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
        if (keepalive := pool.tcp.tcp_keepalive) is not None:
            # SO_KEEPALIVE with the OS's values but for those the rule sets (whole seconds, as Istio).
            options = cluster.upstream_connection_options.tcp_keepalive
            options.SetInParent()
            if keepalive.probes:
                options.keepalive_probes.value = keepalive.probes
            if keepalive.time is not None:
                options.keepalive_time.value = int(keepalive.time.total_seconds())
            if keepalive.interval is not None:
                options.keepalive_interval.value = int(keepalive.interval.total_seconds())


def http_protocol_options(http2: bool, pool: ConnectionPool | None,
                          outbound: bool = True) -> http_options_pb2.HttpProtocolOptions | None:
    """The HTTP protocol options of an Envoy cluster to a port (None: Envoy's defaults, HTTP/1.1),
    as istiod's applyH2Upgrade and applyConnectionPool: HTTP/2 for gRPC and HTTP/2 ports, or when
    h2UpgradePolicy says UPGRADE (outbound, and not with useClientProtocol, which speaks what the
    client spoke); the pool's idle timeout (the HTTP one, else the TCP one), requests per
    connection, connection lifetime and HTTP/2 streams per connection."""
    settings = pool.http if pool is not None else None
    tcp = pool.tcp if pool is not None else None
    upgrade = outbound and settings is not None and not settings.use_client_protocol and (
        settings.h2_upgrade_policy is H2UpgradePolicy.UPGRADE)
    h2 = http2 or upgrade
    options = http_options_pb2.HttpProtocolOptions()
    if h2:
        options.explicit_http_config.http2_protocol_options.SetInParent()
    idle = settings.idle_timeout if settings is not None and settings.idle_timeout is not None else (
        tcp.idle_timeout if tcp is not None else None)
    common = options.common_http_protocol_options
    if idle is not None:
        common.idle_timeout.CopyFrom(duration(idle))
    if settings is not None and settings.max_requests_per_connection:
        common.max_requests_per_connection.value = settings.max_requests_per_connection
    if tcp is not None and tcp.max_connection_duration is not None:
        common.max_connection_duration.CopyFrom(duration(tcp.max_connection_duration))
    if h2 and settings is not None and settings.max_concurrent_streams:
        options.explicit_http_config.http2_protocol_options.max_concurrent_streams.value = settings.max_concurrent_streams
    if settings is not None and settings.use_client_protocol:
        options.use_downstream_protocol_config.http_protocol_options.SetInParent()
        options.use_downstream_protocol_config.http2_protocol_options.SetInParent()
    if options.ByteSize() == 0:
        return None
    if options.WhichOneof("upstream_protocol_options") is None:
        options.explicit_http_config.http_protocol_options.SetInParent()  # as istiod: HTTP/1.1 spelled out
    return options


def proxy_protocol(socket: base_pb2.TransportSocket, version: int) -> base_pb2.TransportSocket:
    """Istio's applyUpstreamProxyProtocol: a PROXY protocol header (v1 or v2) before what `socket`
    sends (TLS or plaintext)."""
    config = proxy_protocol_pb2.ProxyProtocolUpstreamTransport(
        config=proxy_protocol_config_pb2.ProxyProtocolConfig(
            version=proxy_protocol_config_pb2.ProxyProtocolConfig.V1 if version == 1
            else proxy_protocol_config_pb2.ProxyProtocolConfig.V2),
        transport_socket=socket)
    return base_pb2.TransportSocket(name=PROXY_PROTOCOL_TRANSPORT_SOCKET, typed_config=pack(config))


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
    if (cookie := consistent_hash.http_cookie) is not None:
        return [HashPolicy(cookie=HashPolicy.Cookie(
            name=cookie.name, path=cookie.path, ttl=None if cookie.ttl is None else duration(cookie.ttl),
            attributes=[HashPolicy.CookieAttribute(name=n, value=v) for n, v in cookie.attributes]))]
    return []


def duration(value: Duration) -> duration_pb2.Duration:
    result = duration_pb2.Duration()
    result.FromTimedelta(value)
    return result

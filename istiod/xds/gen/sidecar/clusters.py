"""CDS for sidecars: `outbound|<port>|<subset>|<host>` EDS clusters (STRICT_DNS or LOGICAL_DNS ones
for ServiceEntry hosts resolved by DNS, as istiod's) with auto mTLS and the
DestinationRule's policy (istiod/xds/gen/policy.py, shared with proxyless gRPC), the passthrough and
blackhole clusters, and an ORIGINAL_DST `inbound|<port>||` cluster per port the pod serves."""

from __future__ import annotations

from typing import Any

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2 as http_options_pb2
from google.protobuf import any_pb2, duration_pb2, struct_pb2, wrappers_pb2

from istiod.model.config.backend_tls import CONFIG_MAP_CREDENTIAL_PREFIX
from istiod.model.config.networking import ConnectionPool, LocalityLbSetting, Resolution, TLSMode, TrafficPolicy
from istiod.model.mesh import OutboundTrafficPolicy
from istiod.model.names import inbound_cluster_name, outbound_cluster_name, parse_cluster_name
from istiod.model.protocol import Protocol
from istiod.model.proxy import Proxy
from istiod.model.service import Endpoint
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.eds import dns_load_assignment
from istiod.xds.gen.filters import ads_source, pack
from istiod.xds.gen.policy import (
    apply_policy, effective_policy, http_protocol_options, proxy_protocol, subset_endpoints, upstream_mtls,
)
from istiod.xds.gen.sidecar.ports import OutboundPort, inbound_ports, outbound_ports
from istiod.xds.gen.targets import alike, destination_rule, outbound_traffic_policy, sidecar_resource
from istiod.xds.gen.tls import destination_identities, originated_tls, raw_buffer, sds_upstream_tls

BLACKHOLE = "BlackHoleCluster"
PASSTHROUGH = "PassthroughCluster"
INBOUND_PASSTHROUGH = "InboundPassthroughCluster"
# Where inbound clusters connect from, so the capture rules let the connection reach the app
# (istio-init's `-s 127.0.0.6 -j RETURN`).
INBOUND_BIND_ADDRESS = "127.0.0.6"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
CONNECT_TIMEOUT = duration_pb2.Duration(seconds=10)  # istiod's connectTimeout default
_MAX = 4294967295  # Istio lifts Envoy's default circuit-breaker limits (1024) to the maximum


def clusters(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    """Envoy asks for every cluster (wildcard); `names` would narrow it."""
    result = [
        cache.get(types.CLUSTER, name, None, build)
        for name, build in ((BLACKHOLE, blackhole), (PASSTHROUGH, _passthrough),
                            (INBOUND_PASSTHROUGH, _inbound_passthrough))
    ]
    result += outbound_clusters(snapshot, proxy, cache)
    sidecar = sidecar_resource(snapshot, proxy)
    for inbound in inbound_ports(snapshot, proxy):
        name = inbound_cluster_name(inbound.port)
        # The Sidecar's pool for the port, else the served service's DestinationRule's (istiod's order).
        pool = sidecar.connection_pool_for(inbound.port) if sidecar is not None else None
        if pool is None and inbound.service is not None:
            rule = destination_rule(snapshot, proxy, inbound.service)
            pool = effective_policy(rule, inbound.service_port, None).connection_pool if rule is not None else None
        result.append(cache.get(types.CLUSTER, name, pool,
                                lambda: inbound_cluster(name, inbound.protocol, pool, inbound.endpoint),
                                scope=f"{inbound.protocol.value}:{inbound.endpoint}"))
    if names is not None:
        wanted = set(names)
        result = [r for r in result if r.name in wanted]
    return result


def outbound_clusters(snapshot: Snapshot, proxy: Proxy, cache: ResourceCache) -> list[Resource]:
    """An `outbound|<port>|<subset>|<host>` cluster per port and subset of every service the proxy
    sees; gateways have the same ones."""
    # A gateway's differ from a sidecar's (credentialName, headless Services): their own key all the same.
    return list(cache.per_snapshot(snapshot, ("outbound clusters", proxy.type, alike(snapshot, proxy)),
                                   lambda: _outbound_clusters(snapshot, proxy, cache)))


def _outbound_clusters(snapshot: Snapshot, proxy: Proxy, cache: ResourceCache) -> list[Resource]:
    result = []
    sidecar = proxy.type == "sidecar"  # gateways reach passthrough services' endpoints by EDS, as istiod's
    seen: set[str] = set()  # a service port may be on two egress listeners: one cluster
    for target in outbound_ports(snapshot, proxy):
        if target.cluster in seen:
            continue
        seen.add(target.cluster)
        rule = destination_rule(snapshot, proxy, target.service)
        # istiod sends a sidecar a rule's credentialName only from a rule with a workloadSelector
        # (lest every sidecar in its scope wait for a Secret it may not read); gateways always.
        credentials = proxy.type != "sidecar" or (rule is not None and bool(rule.workload_selector))
        for subset in (None, *(rule.subsets if rule is not None else ())):
            name = outbound_cluster_name(target.port.port, target.service.hostname, subset.name if subset else "")
            # The cluster names its destination's identities, so its endpoints matter too.
            all_endpoints = snapshot.endpoints_for(target.service.hostname, target.port.port)
            endpoints = subset_endpoints(all_endpoints, subset)
            original_dst = sidecar and target.service.passthrough
            result.append(cache.get(
                types.CLUSTER, name, (target.service, snapshot.mesh, all_endpoints, rule, subset, credentials),
                lambda: outbound_cluster(target, name, endpoints, snapshot.mesh.trust_domain,
                                         effective_policy(rule, target.port.port, subset),
                                         snapshot.mesh.enable_auto_mtls, snapshot.mesh.locality_lb_setting,
                                         credentials, original_dst),
                scope=f"{rule.meta if rule is not None else ''}:{original_dst}"))
    return result


def outbound_cluster(target: OutboundPort, name: str, endpoints: tuple[Endpoint, ...], trust_domain: str,
                     policy: TrafficPolicy, auto_mtls: bool,
                     mesh_locality: LocalityLbSetting | None, credentials: bool = True,
                     original_dst: bool = False) -> cluster_pb2.Cluster:
    """Auto mTLS, as Istio's: endpoints labelled `tlsMode: istio` (pods with a sidecar) get mTLS,
    the others plaintext; the choice is per endpoint, by the EDS metadata. A DestinationRule's
    TLS mode overrides it (ISTIO_MUTUAL: always, DISABLE: never), its other settings apply on top.
    With meshConfig `enableAutoMtls: false`, or for a MESH_EXTERNAL ServiceEntry's host, only such a
    rule turns mTLS on, as in Istio. Without
    `credentials`, a SIMPLE/MUTUAL rule naming a credentialName gives no TLS at all, as istiod's.
    `original_dst` (a passthrough Service's, for sidecars): to the address the client connected
    to, which carries no tlsMode, so without auto mTLS and load balancing, as istiod's."""
    host, port = target.service.hostname, target.port.port
    identities = destination_identities(endpoints, trust_domain)
    _, _, subset, _ = parse_cluster_name(name)
    sni = f"outbound_.{port}_.{subset}_.{host}"
    options = http_protocol_options(target.protocol.is_http2, policy.connection_pool)
    if target.protocol is Protocol.UNSUPPORTED and not (
            options is not None and options.explicit_http_config.HasField("http2_protocol_options")):
        # A sniffed port: upstream, what the client spoke (istiod's use_downstream_protocol).
        sniffed = _downstream_options()
        if options is not None:
            sniffed.common_http_protocol_options.CopyFrom(options.common_http_protocol_options)
        options = sniffed
    http2 = options is not None and options.explicit_http_config.HasField("http2_protocol_options")
    cluster = cluster_pb2.Cluster(
        name=name,
        connect_timeout=CONNECT_TIMEOUT,
        lb_policy=cluster_pb2.Cluster.LEAST_REQUEST,
        circuit_breakers=_unlimited(),
        transport_socket_matches=[
            cluster_pb2.Cluster.TransportSocketMatch(
                name="tlsMode-istio", match=_struct({"tlsMode": "istio"}),
                transport_socket=sds_upstream_tls(identities, sni, http2),
            ),
            cluster_pb2.Cluster.TransportSocketMatch(
                name="tlsMode-disabled", match=struct_pb2.Struct(), transport_socket=raw_buffer()
            ),
        ],
        metadata=base_pb2.Metadata(filter_metadata={"istio": _struct({"services": [
            {"host": host, "name": target.service.name, "namespace": target.service.namespace}]})}),
    )
    if target.service.dns_resolved:
        # istiod's DNS clusters: the endpoints' names inline, resolved by Envoy (IPv4, as istiod
        # asks on a cluster without IPv6); DNS_ROUND_ROBIN connects to one address at a time.
        cluster.type = (cluster_pb2.Cluster.LOGICAL_DNS if target.service.resolution is Resolution.DNS_ROUND_ROBIN
                        else cluster_pb2.Cluster.STRICT_DNS)
        cluster.dns_lookup_family = cluster_pb2.Cluster.V4_ONLY
        cluster.load_assignment.CopyFrom(dns_load_assignment(name, endpoints))
    elif original_dst:
        cluster.type = cluster_pb2.Cluster.ORIGINAL_DST
    else:
        cluster.type = cluster_pb2.Cluster.EDS
        cluster.eds_cluster_config.CopyFrom(cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=ads_source(initial_fetch_timeout=duration_pb2.Duration()), service_name=name))
    tls = policy.tls
    if tls is None and (not auto_mtls or original_dst or target.service.mesh_external):
        del cluster.transport_socket_matches[:]  # plaintext to every endpoint (istiod: no auto mTLS outside the mesh)
    if tls is not None:
        del cluster.transport_socket_matches[:]
        # (A ConfigMap's CA is no secret: every sidecar may have it, as istiod.)
        if (tls.mode in (TLSMode.SIMPLE, TLSMode.MUTUAL) and tls.credential_name and not credentials
                and not tls.credential_name.startswith(CONFIG_MAP_CREDENTIAL_PREFIX)):
            cluster.transport_socket.CopyFrom(raw_buffer())  # istiod builds no TLS context
        elif tls.mode in (TLSMode.SIMPLE, TLSMode.MUTUAL):
            # ALPN h2 on an HTTP/2 cluster (an h2 upgrade included), as istiod's isHttp2Cluster.
            cluster.transport_socket.CopyFrom(originated_tls(tls, ("h2",) if http2 else (),
                                                             target.service.subject_alt_names))
            if target.protocol.is_http and not tls.sni:
                # istiod's auto SNI (and SAN check) from the request's Host when the rule names none
                # (the rule's own SANs decide, not the ServiceEntry's it falls back to: as istiod).
                if options is None:
                    options = _explicit_options(target.protocol)
                options.upstream_http_protocol_options.CopyFrom(protocol_pb2.UpstreamHttpProtocolOptions(
                    auto_sni=True, auto_san_validation=not (tls.subject_alt_names or tls.insecure_skip_verify)))
        else:
            # ISTIO_MUTUAL: the rule's SNI and SANs when it names them (an egress gateway's server
            # matches the external host as SNI), as istiod's buildIstioMutualTLS.
            cluster.transport_socket.CopyFrom(
                sds_upstream_tls(tls.subject_alt_names or identities, tls.sni or sni, http2) if upstream_mtls(tls, True)
                else raw_buffer())
    if options is not None:
        cluster.typed_extension_protocol_options[HTTP_OPTIONS].CopyFrom(pack(options))
    if policy.proxy_protocol is not None:
        if not cluster.HasField("transport_socket") and not cluster.transport_socket_matches:
            cluster.transport_socket.CopyFrom(raw_buffer())
        if cluster.HasField("transport_socket"):
            cluster.transport_socket.CopyFrom(proxy_protocol(cluster.transport_socket, policy.proxy_protocol))
        for match in cluster.transport_socket_matches:
            match.transport_socket.CopyFrom(proxy_protocol(match.transport_socket, policy.proxy_protocol))
    apply_policy(cluster, policy, mesh_locality)
    if original_dst:  # Envoy allows no other policy on ORIGINAL_DST; istiod drops the rule's
        for field in ("ring_hash_lb_config", "least_request_lb_config", "load_balancing_policy"):
            cluster.ClearField(field)
        cluster.lb_policy = cluster_pb2.Cluster.CLUSTER_PROVIDED
    return cluster


def inbound_cluster(name: str, protocol: Protocol, pool: ConnectionPool | None,
                    endpoint: tuple[str, int] | None = None) -> cluster_pb2.Cluster:
    """To the app in the same pod: the connection's original destination, or the Sidecar ingress
    listener's defaultEndpoint (a STATIC cluster, as istiod's), within the Sidecar resource's
    inbound connection pool if it sets one. From 127.0.0.6 unless to loopback, which capture
    never takes."""
    options = _protocol_options(protocol, pool)
    if endpoint is None:
        cluster = _original_dst(name, options, bind=True)
    else:
        address, port = endpoint
        cluster = cluster_pb2.Cluster(
            name=name, type=cluster_pb2.Cluster.STATIC, connect_timeout=CONNECT_TIMEOUT,
            circuit_breakers=_unlimited(), typed_extension_protocol_options=options,
            load_assignment=endpoint_pb2.ClusterLoadAssignment(cluster_name=name, endpoints=[
                endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[endpoint_components_pb2.LbEndpoint(
                    endpoint=endpoint_components_pb2.Endpoint(address=address_pb2.Address(
                        socket_address=address_pb2.SocketAddress(address=address, port_value=port))))])]))
        if address not in ("127.0.0.1", "::1"):
            cluster.upstream_bind_config.CopyFrom(_inbound_bind())
    if pool is not None:
        apply_policy(cluster, TrafficPolicy(connection_pool=pool), None)
    return cluster


def unmatched_cluster(snapshot: Snapshot, proxy: Proxy) -> str:
    """Where the sidecar sends what no service claims (istiod's catch-all): nowhere under
    REGISTRY_ONLY, else out as it came, or to its Sidecar resource's egressProxy."""
    if outbound_traffic_policy(snapshot, proxy) is OutboundTrafficPolicy.REGISTRY_ONLY:
        return BLACKHOLE
    sidecar = sidecar_resource(snapshot, proxy)
    egress = sidecar.egress_proxy if sidecar is not None else None
    return outbound_cluster_name(egress.port, egress.host, egress.subset) if egress is not None else PASSTHROUGH


def blackhole() -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster(name=BLACKHOLE, type=cluster_pb2.Cluster.STATIC, connect_timeout=CONNECT_TIMEOUT)


def _passthrough() -> cluster_pb2.Cluster:
    return _original_dst(PASSTHROUGH, _downstream_protocol(), bind=False)


def _inbound_passthrough() -> cluster_pb2.Cluster:
    return _original_dst(INBOUND_PASSTHROUGH, _downstream_protocol(), bind=True)


def _original_dst(name: str, options: dict[str, object], bind: bool) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.ORIGINAL_DST,
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        connect_timeout=CONNECT_TIMEOUT,
        circuit_breakers=_unlimited(),
        typed_extension_protocol_options=options,
        upstream_bind_config=_inbound_bind() if bind else None,
    )


def _inbound_bind() -> address_pb2.BindConfig:
    return address_pb2.BindConfig(source_address=address_pb2.SocketAddress(address=INBOUND_BIND_ADDRESS, port_value=0))


def _protocol_options(protocol: Protocol, pool: ConnectionPool | None = None) -> dict[str, object]:
    """HTTP/2 upstream for gRPC and HTTP/2 ports; the client's for sniffed ones (istiod's
    use_downstream_protocol); Envoy's default (HTTP/1.1) for the others; the inbound connection
    pool's HTTP settings (no h2 upgrade inbound, as istiod)."""
    if protocol is Protocol.UNSUPPORTED:
        return _downstream_protocol()
    options = http_protocol_options(protocol.is_http2, pool, outbound=False)
    return {HTTP_OPTIONS: pack(options)} if options is not None else {}


def _explicit_options(protocol: Protocol) -> http_options_pb2.HttpProtocolOptions:
    explicit = http_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
        http2_protocol_options=protocol_pb2.Http2ProtocolOptions() if protocol.is_http2 else None,
        http_protocol_options=None if protocol.is_http2 else protocol_pb2.Http1ProtocolOptions())
    return http_options_pb2.HttpProtocolOptions(explicit_http_config=explicit)


def _downstream_protocol() -> dict[str, object]:
    """Passthrough clusters speak to the upstream whatever the client spoke."""
    return {HTTP_OPTIONS: pack(_downstream_options())}


def _downstream_options() -> http_options_pb2.HttpProtocolOptions:
    return http_options_pb2.HttpProtocolOptions(
        use_downstream_protocol_config=http_options_pb2.HttpProtocolOptions.UseDownstreamHttpConfig(
            http_protocol_options=protocol_pb2.Http1ProtocolOptions(),
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions(),
        )
    )


def _unlimited() -> circuit_breaker_pb2.CircuitBreakers:
    limit = wrappers_pb2.UInt32Value(value=_MAX)
    return circuit_breaker_pb2.CircuitBreakers(thresholds=[circuit_breaker_pb2.CircuitBreakers.Thresholds(
        max_connections=limit, max_pending_requests=limit, max_requests=limit, max_retries=limit,
        track_remaining=True,
    )])


def _struct(values: dict[str, Any]) -> struct_pb2.Struct:
    result = struct_pb2.Struct()
    result.update(values)
    return result


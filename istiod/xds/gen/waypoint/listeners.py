"""LDS for waypoints, as Istio's listener_waypoint.go, built from upstream Envoy filters only:

- `connect_terminate` (0.0.0.0:15008): HBONE in. mTLS with the waypoint's certificate (SDS), an HCM
  taking HTTP/2 CONNECT; `envoy.filters.http.set_filter_state` keeps the CONNECT target (the
  service's VIP:port) as `envoy.filters.listener.original_dst.local_ip`, shared with the upstream, and
  the router tunnels the stream's bytes (upgrade CONNECT) to the internal listener `main_internal`.
- `main_internal` (internal): original_dst takes that target as its destination; a filter chain per
  port of each service that uses this waypoint, matched by VIP and port: the service's L7 routes
  (VirtualService, HTTPRoute with a Service parent, translated as for sidecars) in an HCM, behind the
  RBAC of the AuthorizationPolicies whose targetRefs name the waypoint or the service, or tcp_proxy for
  TCP ports; to `inbound-vip|...` clusters (waypoint/clusters.py). The rest is closed.
- `connect_originate` (internal): original_dst takes the pod address the endpoint's metadata carried
  here; tcp_proxy tunnels the bytes in a CONNECT to `%DOWNSTREAM_LOCAL_ADDRESS%` (pod:port) over the
  `connect_originate` cluster (the pod's ztunnel on 15008).
"""

from __future__ import annotations

from envoy.config.core.v3 import address_pb2, base_pb2, protocol_pb2, substitution_format_string_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.common.set_filter_state.v3 import value_pb2
from envoy.extensions.filters.http.set_filter_state.v3 import set_filter_state_pb2
from envoy.extensions.filters.listener.original_dst.v3 import original_dst_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from google.protobuf import duration_pb2, wrappers_pb2

from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.filters import (
    HCM_FILTER, TCP_PROXY_FILTER, http_connection_manager, network_filter, pack, tcp_proxy, with_fault_filter,
)
from istiod.xds.gen.rbac import PEER_PRINCIPAL_STATE, tcp_authorization_filters
from istiod.xds.gen.security import WorkloadPolicy, fetched_keys
from istiod.xds.gen.sidecar.clusters import BLACKHOLE
from istiod.xds.gen.sidecar.listeners import ORIGINAL_DST_FILTER
from istiod.xds.gen.targets import alike, hash_lookup, route_inputs
from istiod.xds.gen.tls import sds_downstream_tls
from istiod.xds.gen.waypoint.clusters import CONNECT_ORIGINATE, HBONE_PORT, MAIN_INTERNAL
from istiod.xds.gen.waypoint.services import (
    WaypointPort, attached_authentications, attached_policies, service_routes, waypoint_cluster_name, waypoint_ports,
)

CONNECT_TERMINATE = "connect_terminate"
BLACKHOLE_CHAIN = "virtualInbound-blackhole"
CONNECT = "CONNECT"
SET_FILTER_STATE_FILTER = "envoy.filters.http.set_filter_state"
ORIGINAL_DST_LOCAL_IP = "envoy.filters.listener.original_dst.local_ip"
_NO_TIMEOUT = duration_pb2.Duration()


def listeners(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    ports = tuple(waypoint_ports(snapshot, proxy))
    result = [cache.get(types.LISTENER, CONNECT_TERMINATE, None, connect_terminate),
              cache.get(types.LISTENER, CONNECT_ORIGINATE, None, connect_originate)]
    # Routes depend on the services, their VirtualServices (and HTTPRoutes) and DestinationRules.
    depends_on = (snapshot.mesh, *ports, *(d for p in ports for d in route_inputs(snapshot, proxy, p.service)[1]),
                  *(a for p in ports for a in attached_policies(snapshot, proxy, p.service)),
                  *(a for p in ports for a in attached_authentications(snapshot, proxy, p.service)),
                  snapshot.jwks)
    result.append(cache.get(types.LISTENER, MAIN_INTERNAL, depends_on, lambda: main_internal(snapshot, proxy, ports),
                            scope=str(alike(snapshot, proxy))))
    if names is not None:
        wanted = set(names)
        result = [r for r in result if r.name in wanted]
    return result


def connect_terminate() -> listener_pb2.Listener:
    route = rc.Route(
        match=rc.RouteMatch(connect_matcher=rc.RouteMatch.ConnectMatcher()),
        route=rc.RouteAction(cluster=MAIN_INTERNAL, upgrade_configs=[rc.RouteAction.UpgradeConfig(
            upgrade_type=CONNECT, connect_config=rc.RouteAction.UpgradeConfig.ConnectConfig())]))
    # The CONNECT target, for main_internal's original_dst (Istio's `connect_authority` filter), and
    # the caller's identity (the certificate the source's ztunnel presented), for its RBAC.
    target = set_filter_state_pb2.Config(on_request_headers=[
        value_pb2.FilterStateValue(
            object_key=ORIGINAL_DST_LOCAL_IP,
            format_string=substitution_format_string_pb2.SubstitutionFormatString(
                text_format_source=base_pb2.DataSource(inline_string="%REQ(:AUTHORITY)%")),
            shared_with_upstream=value_pb2.FilterStateValue.ONCE),
        value_pb2.FilterStateValue(
            object_key=PEER_PRINCIPAL_STATE, factory_key="envoy.hashable_string",
            format_string=substitution_format_string_pb2.SubstitutionFormatString(
                text_format_source=base_pb2.DataSource(inline_string="%DOWNSTREAM_PEER_URI_SAN%")),
            shared_with_upstream=value_pb2.FilterStateValue.ONCE)])
    manager = http_connection_manager(
        [hcm_pb2.HttpFilter(name=SET_FILTER_STATE_FILTER, typed_config=pack(target))],
        stat_prefix=CONNECT_TERMINATE,
        route_config=route_pb2.RouteConfiguration(name="default", virtual_hosts=[
            rc.VirtualHost(name="default", domains=["*"], routes=[route])]),
        use_remote_address=wrappers_pb2.BoolValue(value=False),
        stream_idle_timeout=_NO_TIMEOUT,
        upgrade_configs=[hcm_pb2.HttpConnectionManager.UpgradeConfig(upgrade_type=CONNECT)],
        http2_protocol_options=protocol_pb2.Http2ProtocolOptions(
            allow_connect=True, max_concurrent_streams=wrappers_pb2.UInt32Value(value=100)))
    return listener_pb2.Listener(
        name=CONNECT_TERMINATE,
        address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address="0.0.0.0", port_value=HBONE_PORT)),
        filter_chains=[listener_components_pb2.FilterChain(
            # HBONE is HTTP/2 only: h2 alone, as istiod's.
            name="default", transport_socket=sds_downstream_tls(("h2",)),
            filters=[network_filter(HCM_FILTER, manager)])],
        # Few long-lived HBONE connections, each carrying many streams: spread them evenly (as Istio).
        connection_balance_config=listener_pb2.Listener.ConnectionBalanceConfig(
            exact_balance=listener_pb2.Listener.ConnectionBalanceConfig.ExactBalance()))


def main_internal(snapshot: Snapshot, proxy: Proxy, ports: tuple[WaypointPort, ...]) -> listener_pb2.Listener:
    hash_for = hash_lookup(snapshot, proxy)
    chains = []
    for waypoint_port in ports:
        service, number = waypoint_port.service, waypoint_port.port.port
        name = waypoint_cluster_name(number, service.hostname, "", waypoint_port.http)
        policies = attached_policies(snapshot, proxy, service)
        if waypoint_port.http:
            request_auth = attached_authentications(snapshot, proxy, service)
            authz = WorkloadPolicy(policies, request_auth, {}, fetched_keys(snapshot, request_auth)).http_filters(
                f"waypoint {proxy.namespace}/{proxy.pod_name}, {name}", peer_state=True)
            routes = service_routes(snapshot, proxy, waypoint_port, hash_for)
            # Faults and CORS policies ride on the routes and act only where their filters are.
            manager = with_fault_filter(http_connection_manager(
                authz, stat_prefix=name, use_remote_address=wrappers_pb2.BoolValue(value=False),
                normalize_path=wrappers_pb2.BoolValue(value=True),
                route_config=route_pb2.RouteConfiguration(
                    name=name, validate_clusters=wrappers_pb2.BoolValue(value=False),
                    virtual_hosts=[rc.VirtualHost(name=name, domains=["*"], routes=routes)])), cors=True)
            main = network_filter(HCM_FILTER, manager)
        else:
            main = network_filter(TCP_PROXY_FILTER, tcp_proxy_pb2.TcpProxy(stat_prefix=name, cluster=name))
        before = [] if waypoint_port.http else list(tcp_authorization_filters(policies, {}, peer_state=True).filters)
        chains.append(listener_components_pb2.FilterChain(
            name=name, filters=[*before, main], filter_chain_match=listener_components_pb2.FilterChainMatch(
                destination_port=wrappers_pb2.UInt32Value(value=number),
                prefix_ranges=[address_pb2.CidrRange(address_prefix=waypoint_port.vip,
                                                     prefix_len=wrappers_pb2.UInt32Value(
                                                         value=128 if ":" in waypoint_port.vip else 32))])))
    # What no service's chain takes (a pod addressed directly: not served here) is closed; Envoy also
    # refuses a listener without chains, as this one is while no service uses the waypoint.
    chains.append(listener_components_pb2.FilterChain(name=BLACKHOLE_CHAIN, filters=[tcp_proxy(BLACKHOLE, BLACKHOLE)]))
    return _internal(MAIN_INTERNAL, chains, base_pb2.INBOUND)


def connect_originate() -> listener_pb2.Listener:
    tunnel = tcp_proxy_pb2.TcpProxy(
        stat_prefix=CONNECT_ORIGINATE, cluster=CONNECT_ORIGINATE,
        tunneling_config=tcp_proxy_pb2.TcpProxy.TunnelingConfig(hostname="%DOWNSTREAM_LOCAL_ADDRESS%"))
    return _internal(CONNECT_ORIGINATE, [listener_components_pb2.FilterChain(
        filters=[network_filter(TCP_PROXY_FILTER, tunnel)])])


def _internal(name: str, chains: list[listener_components_pb2.FilterChain],
              direction: base_pb2.TrafficDirection.ValueType = base_pb2.UNSPECIFIED) -> listener_pb2.Listener:
    """An internal listener whose destination is what its upstream passed along (filter state or the
    endpoint's metadata), read by original_dst."""
    return listener_pb2.Listener(
        name=name, internal_listener=listener_pb2.Listener.InternalListenerConfig(),
        use_original_dst=wrappers_pb2.BoolValue(value=False), traffic_direction=direction,
        listener_filters=[listener_components_pb2.ListenerFilter(
            name=ORIGINAL_DST_FILTER, typed_config=pack(original_dst_pb2.OriginalDst()))],
        filter_chains=chains)

"""Building blocks every flavor's listeners and clusters share: Any packing, the ADS config
source, the HTTP connection manager with the router last. Upstream Envoy extension names only."""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.core.v3 import config_source_pb2
from envoy.config.listener.v3 import listener_components_pb2
from envoy.extensions.filters.http.cors.v3 import cors_pb2
from envoy.extensions.filters.http.fault.v3 import fault_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message

from istiod.model.config.networking import TunnelSettings

ROUTER_FILTER = "envoy.filters.http.router"
FAULT_FILTER = "envoy.filters.http.fault"
CORS_FILTER = "envoy.filters.http.cors"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
TCP_PROXY_FILTER = "envoy.filters.network.tcp_proxy"


def pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def ads_source(initial_fetch_timeout: duration_pb2.Duration | None = None) -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.V3,
        initial_fetch_timeout=initial_fetch_timeout,
    )


def http_connection_manager(http_filters: Sequence[hcm_pb2.HttpFilter] = (), /,
                            **fields: object) -> hcm_pb2.HttpConnectionManager:
    """`http_filters` run in order before the router."""
    return hcm_pb2.HttpConnectionManager(
        http_filters=[*http_filters, hcm_pb2.HttpFilter(name=ROUTER_FILTER, typed_config=pack(router_pb2.Router()))],
        **fields,  # type: ignore[arg-type]
    )


def with_fault_filter(manager: hcm_pb2.HttpConnectionManager, cors: bool = False) -> hcm_pb2.HttpConnectionManager:
    """The fault filter (and for Envoy the CORS filter) just before the router, as istiod places
    them: VirtualService faults and CORS policies ride on routes (typed_per_filter_config) and act
    only where the filter is in the chain. gRPC has no CORS filter."""
    added = [hcm_pb2.HttpFilter(name=FAULT_FILTER, typed_config=pack(fault_pb2.HTTPFault()))]
    if cors:
        added.append(hcm_pb2.HttpFilter(name=CORS_FILTER, typed_config=pack(cors_pb2.Cors())))
    for http_filter in added:  # each in turn just before the router
        manager.http_filters.insert(len(manager.http_filters) - 1, http_filter)
    return manager


def network_filter(name: str, config: Message) -> listener_components_pb2.Filter:
    return listener_components_pb2.Filter(name=name, typed_config=pack(config))


def tcp_proxy(stat_prefix: str, cluster: str, tunnel: TunnelSettings | None = None) -> listener_components_pb2.Filter:
    return network_filter(TCP_PROXY_FILTER, tcp_proxy_pb2.TcpProxy(stat_prefix=stat_prefix, cluster=cluster,
                                                                   tunneling_config=_tunneling_config(tunnel)))


def l4_proxy(stat_prefix: str, destinations: Sequence[tuple[str, int]],
             tunnel: TunnelSettings | None = None) -> listener_components_pb2.Filter:
    """tcp_proxy to (cluster, weight) destinations: the one cluster itself, else weighted; with
    `tunnel`, the bytes ride in an HTTP CONNECT (or POST) to the upstream (a DestinationRule's)."""
    if len(destinations) == 1:
        return tcp_proxy(destinations[0][0], destinations[0][0], tunnel)
    return network_filter(TCP_PROXY_FILTER, tcp_proxy_pb2.TcpProxy(
        stat_prefix=stat_prefix, weighted_clusters=tcp_proxy_pb2.TcpProxy.WeightedCluster(clusters=[
            tcp_proxy_pb2.TcpProxy.WeightedCluster.ClusterWeight(name=name, weight=weight)
            for name, weight in destinations]), tunneling_config=_tunneling_config(tunnel)))


def _tunneling_config(tunnel: TunnelSettings | None) -> tcp_proxy_pb2.TcpProxy.TunnelingConfig | None:
    if tunnel is None:
        return None
    return tcp_proxy_pb2.TcpProxy.TunnelingConfig(hostname=tunnel.hostname, use_post=tunnel.use_post)

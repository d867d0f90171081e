"""Proxyless gRPC: LDS, RDS and CDS with Istio's names.

Outbound listeners are named as the client asks (`host:port`, host in any alias form) and point at
a route configuration named `<fqdn>:<port>`; inbound listeners serve xDS-enabled gRPC servers.
"""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.config.listener.v3 import api_listener_pb2, listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2

from istiod.model.names import (
    INBOUND_LISTENER_PREFIX,
    inbound_cluster_name,
    join_host_port,
    split_host_port,
)
from istiod.model.proxy import Proxy
from istiod.model.service import Service
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.filters import HCM_FILTER, ads_source, http_connection_manager, pack
from istiod.xds.gen.targets import outbound_clusters, outbound_host_ports
from istiod.xds.gen.tls import destination_identities, downstream_tls, upstream_tls


def listeners(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    inbound = [n for n in names or () if n.startswith(INBOUND_LISTENER_PREFIX)]
    result = [
        cache.get(types.LISTENER, name, service, lambda: _outbound_listener(name, service, port))
        for name, service, port in outbound_host_ports(snapshot, proxy, names)
    ]
    for name in inbound:
        address = _inbound_address(snapshot, proxy, name)
        if address is not None:  # whether it exists is per proxy; what it holds depends on name and mesh only
            result.append(cache.get(types.LISTENER, name, snapshot.mesh,
                                    lambda: _inbound_listener(name, *address, snapshot.mesh.mtls)))
    return result


def routes(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    return [
        cache.get(types.ROUTE, name, service, lambda: _route_configuration(name, service, port))
        for name, service, port in outbound_host_ports(snapshot, proxy, names)
    ]


def clusters(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    result = []
    for name, service, port in outbound_clusters(snapshot, proxy, names):
        # With mTLS the cluster names its destination's identities, so its endpoints matter too.
        endpoints = snapshot.endpoints_for(service.hostname, port) if snapshot.mesh.mtls else None
        depends_on = (service, snapshot.mesh, endpoints)
        result.append(cache.get(types.CLUSTER, name, depends_on, lambda: _cluster(
            name, None if endpoints is None else destination_identities(endpoints, snapshot.mesh.trust_domain))))
    return result


def _outbound_listener(name: str, service: Service, port: int) -> listener_pb2.Listener:
    rds = hcm_pb2.Rds(config_source=ads_source(), route_config_name=f"{service.hostname}:{port}")
    return listener_pb2.Listener(
        name=name,
        api_listener=api_listener_pb2.ApiListener(api_listener=pack(http_connection_manager(rds=rds))),
    )


def _route_configuration(name: str, service: Service, port: int) -> route_pb2.RouteConfiguration:
    # gRPC matches the virtual host against the target's authority, which may be any alias.
    domains = [
        domain
        for alias in service.aliases
        for domain in (alias, f"{alias}:{port}")
    ]
    return route_pb2.RouteConfiguration(
        name=name,
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name=f"{service.hostname}:{port}",
                domains=domains,
                routes=[
                    route_components_pb2.Route(
                        match=route_components_pb2.RouteMatch(prefix=""),
                        route=route_components_pb2.RouteAction(cluster=service.cluster_name(port)),
                    )
                ],
            )
        ],
    )


def _cluster(name: str, identities: tuple[str, ...] | None) -> cluster_pb2.Cluster:
    """An EDS cluster; with `identities` (mTLS on) it talks TLS and checks the peer is one of them."""
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=ads_source(),
            service_name=name,
        ),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
        transport_socket=None if identities is None else upstream_tls(identities),
    )


def _inbound_address(snapshot: Snapshot, proxy: Proxy, name: str) -> tuple[str, int] | None:
    """The listener's ip:port, if the proxy serves some Service on that port (else no listener)."""
    try:
        ip, port = split_host_port(name[len(INBOUND_LISTENER_PREFIX):])
    except ValueError:
        return None
    addresses = proxy.ip_addresses if ip in ("0.0.0.0", "::") else (ip,)
    if not any(snapshot.instances_at(address, port) for address in addresses if address in proxy.ip_addresses):
        return None
    return ip, port


def _inbound_listener(name: str, ip: str, port: int, mtls: bool) -> listener_pb2.Listener:
    """A listener for an xDS-enabled gRPC server: every request is served locally."""
    route = route_pb2.RouteConfiguration(
        name=inbound_cluster_name(port),
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name=inbound_cluster_name(port),
                domains=["*"],
                routes=[
                    route_components_pb2.Route(
                        match=route_components_pb2.RouteMatch(prefix="/"),
                        non_forwarding_action=route_components_pb2.NonForwardingAction(),
                    )
                ],
            )
        ],
    )
    chain = listener_components_pb2.FilterChain(
        name=inbound_cluster_name(port),
        filters=[
            listener_components_pb2.Filter(
                name=HCM_FILTER,
                typed_config=pack(http_connection_manager(stat_prefix=join_host_port(ip, port), route_config=route)),
            )
        ],
        # gRPC servers cannot tell TLS from plaintext on one port, so mTLS on means STRICT.
        transport_socket=downstream_tls() if mtls else None,
    )
    return listener_pb2.Listener(
        name=name,
        address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address=ip, port_value=port)),
        filter_chains=[chain],
        traffic_direction=base_pb2.INBOUND,
    )

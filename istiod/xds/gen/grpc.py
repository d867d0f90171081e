"""Proxyless gRPC: LDS, RDS and CDS with Istio's names.

Outbound listeners are named as the client asks (`host:port`, host in any alias form) and point at
a route configuration named as istiod names it, `outbound|<port>||<fqdn>`, which carries the
VirtualService's routes (routes.py); clusters carry the DestinationRule's policy (policy.py), a
subset's cluster `outbound|<port>|<subset>|<fqdn>` only its endpoints. Inbound listeners serve
xDS-enabled gRPC servers.
"""

from __future__ import annotations

import dataclasses
import logging

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.config.listener.v3 import api_listener_pb2, listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2

from istiod.model.config.security import AuthorizationPolicy, MTLSMode, RequestAuthentication
from istiod.model.config.networking import LocalityLbSetting, TrafficPolicy, VirtualService
from istiod.model.names import (
    INBOUND_LISTENER_PREFIX,
    inbound_cluster_name,
    join_host_port,
    split_host_port,
)
from istiod.model.proxy import Proxy
from istiod.model.service import Endpoint, Service
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.eds import dns_load_assignment
from istiod.xds.gen.filters import HCM_FILTER, ads_source, http_connection_manager, pack, with_fault_filter
from istiod.xds.gen.policy import apply_policy, effective_policy, subset_endpoints, upstream_mtls
from istiod.xds.gen.rbac import authorization_filters
from istiod.xds.gen.routes import http_routes
from istiod.xds.gen.security import authorization_policies, inbound_mtls_mode, request_authentications
from istiod.xds.gen.targets import alike, hash_lookup, outbound_clusters, outbound_host_ports, route_inputs
from istiod.xds.gen.tls import destination_identities, downstream_tls, upstream_tls

log = logging.getLogger(__name__)


def listeners(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    inbound = [n for n in names or () if n.startswith(INBOUND_LISTENER_PREFIX)]
    result = [
        cache.get(types.LISTENER, name, service, lambda: _outbound_listener(name, service, port))
        for name, service, port in outbound_host_ports(snapshot, proxy, names)
    ]
    for name in inbound:
        address = _inbound_address(snapshot, proxy, name)
        if address is None:
            continue
        ip, port = address
        mode = inbound_mtls_mode(snapshot, proxy, port)
        policies = authorization_policies(snapshot, proxy)
        jwt = request_authentications(snapshot, proxy)
        # What it holds depends on the workload's labels and namespace: one entry per proxy.
        result.append(cache.get(types.LISTENER, name, (mode, *policies, *jwt), scope=proxy.id,
                                build=lambda: _inbound_listener(name, ip, port, mode, policies, jwt)))
    return result


def routes(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    """Route configurations `outbound|<port>||<host>`, as istiod names them for gRPC."""
    result = []
    for target in outbound_clusters(snapshot, proxy, names):
        if target.subset is not None:
            continue
        service, port = target.service, target.port
        vs, depends_on = route_inputs(snapshot, proxy, service)
        # VirtualService visibility and DestinationRule lookup depend on the proxy's namespace and labels.
        result.append(cache.get(types.ROUTE, target.name, depends_on,
                                lambda: _route_configuration(target.name, service, port, vs, snapshot, proxy),
                                scope=str(alike(snapshot, proxy))))
    return result


def clusters(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    result = []
    for target in outbound_clusters(snapshot, proxy, names):
        service = target.service
        policy = effective_policy(target.rule, target.port, target.subset)
        # Mesh mTLS is for the mesh's own services; a ServiceEntry's host gets it only if a rule asks.
        mtls = upstream_mtls(policy.tls, snapshot.mesh.mtls and not service.external_host)
        # With mTLS the cluster names its destination's identities, so its endpoints matter too;
        # a DNS cluster carries its endpoints itself. (The service's tuple keeps its identity
        # while unchanged; a subset's is filtered anew.)
        all_endpoints = snapshot.endpoints_for(service.hostname, target.port)
        endpoints = subset_endpoints(all_endpoints, target.subset)
        depends_on = (service, snapshot.mesh, all_endpoints if mtls or service.dns_resolved else None,
                      target.rule, target.subset)
        result.append(cache.get(types.CLUSTER, target.name, depends_on, lambda: _cluster(
            target.name, service, endpoints, policy,
            destination_identities(endpoints, snapshot.mesh.trust_domain) if mtls else None,
            snapshot.mesh.locality_lb_setting),
            # A sidecar's cluster of the same name and inputs differs: the flavor is part of the key.
            scope=f"proxyless {target.rule.meta if target.rule else ''}"))
    return result


def _outbound_listener(name: str, service: Service, port: int) -> listener_pb2.Listener:
    rds = hcm_pb2.Rds(config_source=ads_source(), route_config_name=service.cluster_name(port))
    return listener_pb2.Listener(
        name=name,
        api_listener=api_listener_pb2.ApiListener(api_listener=pack(with_fault_filter(http_connection_manager(rds=rds)))),
    )


def _route_configuration(name: str, service: Service, port: int, vs: VirtualService | None,
                         snapshot: Snapshot, proxy: Proxy) -> route_pb2.RouteConfiguration:
    # gRPC matches the virtual host against the target's authority, which may be any alias, or
    # the bare name from the Service's own namespace.
    local = proxy.namespace == service.namespace and not service.external_host
    aliases = [*service.aliases, *([service.name] if local else [])]
    domains = [domain for alias in aliases for domain in (alias, f"{alias}:{port}")]
    return route_pb2.RouteConfiguration(
        name=name,
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name=f"{service.hostname}:{port}",
                domains=domains,
                routes=http_routes(vs, service, port, snapshot.services, hash_lookup(snapshot, proxy), proxyless=True,
                                   source=(proxy.namespace, dict(proxy.labels))),
            )
        ],
    )


def _cluster(name: str, service: Service, endpoints: tuple[Endpoint, ...], policy: TrafficPolicy,
             identities: tuple[str, ...] | None, mesh_locality: LocalityLbSetting | None) -> cluster_pb2.Cluster:
    """An EDS cluster, or for a DNS-resolved ServiceEntry host a LOGICAL_DNS one (the only DNS
    type gRPC knows: it NACKs STRICT_DNS); with `identities` (mTLS on) it talks TLS and checks the
    peer is one of them."""
    cluster = cluster_pb2.Cluster(
        name=name,
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
        transport_socket=None if identities is None else upstream_tls(identities),
    )
    if service.dns_resolved:
        cluster.type = cluster_pb2.Cluster.LOGICAL_DNS
        cluster.load_assignment.CopyFrom(dns_load_assignment(name, endpoints))
    else:
        cluster.type = cluster_pb2.Cluster.EDS
        cluster.eds_cluster_config.eds_config.CopyFrom(ads_source())
        cluster.eds_cluster_config.service_name = name
    # No retry budget: gRPC has none (istiod's grpcgen sends its circuit breakers' max requests only).
    apply_policy(cluster, dataclasses.replace(policy, retry_budget=None), mesh_locality)
    if cluster.lb_policy == cluster_pb2.Cluster.MAGLEV:
        # gRPC has no maglev (it NACKs the cluster); its ring hash keeps the same key on the same backend.
        cluster.lb_policy = cluster_pb2.Cluster.RING_HASH
        cluster.ClearField("maglev_lb_config")
    return cluster


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


def _inbound_listener(name: str, ip: str, port: int, mode: MTLSMode, policies: tuple[AuthorizationPolicy, ...],
                      jwt: tuple[RequestAuthentication, ...] = ()) -> listener_pb2.Listener:
    """A listener for an xDS-enabled gRPC server: every request is served locally, after the RBAC
    filters of the AuthorizationPolicies that select the workload."""
    authz = authorization_filters(policies, proxyless=True)
    for problem in authz.problems:
        log.warning("%s (proxyless inbound listener %s)", problem, name)
    for policy in jwt:  # as istiod's gRPC generator: gRPC has no JWT filter
        log.warning("RequestAuthentication %s is not enforced on proxyless gRPC servers (no JWT filter in gRPC): "
                    "tokens are not checked on %s, and requestPrincipals rules fail closed", policy.meta, name)
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
                typed_config=pack(http_connection_manager(
                    authz.filters, stat_prefix=join_host_port(ip, port), route_config=route)),
            )
        ],
        # gRPC's filter chain match ignores transport_protocol, so a server cannot tell TLS from
        # plaintext on one port: PERMISSIVE serves plaintext, as DISABLE does (mTLS clients fail).
        transport_socket=downstream_tls() if mode is MTLSMode.STRICT else None,
    )
    return listener_pb2.Listener(
        name=name,
        address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address=ip, port_value=port)),
        filter_chains=[chain],
        traffic_direction=base_pb2.INBOUND,
    )

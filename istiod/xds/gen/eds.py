"""EDS: ClusterLoadAssignments for `outbound|port|subset|host` clusters, grouped by locality."""

from __future__ import annotations

import ipaddress
from itertools import groupby

from envoy.config.core.v3 import address_pb2, base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from google.protobuf import struct_pb2, wrappers_pb2

from istiod.model.entries import TLS_MODE_LABEL
from istiod.model.mesh import MeshConfig
from istiod.model.proxy import Proxy
from istiod.model.service import Endpoint, Locality
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen import locality, network
from istiod.xds.gen.locality import LocalityLb
from istiod.xds.gen.policy import effective_policy, subset_endpoints
from istiod.xds.gen.targets import alike, outbound_clusters

# Where a cluster's transport_socket_matches look for an endpoint's tlsMode (auto mTLS).
TRANSPORT_SOCKET_MATCH = "envoy.transport_socket_match"


def endpoints(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    key = ("eds", alike_for_eds(snapshot, proxy, cache), None if names is None else tuple(names))
    return list(cache.per_snapshot(snapshot, key, lambda: assignments(snapshot, proxy, names, cache)))


def alike_for_eds(snapshot: Snapshot, proxy: Proxy, cache: ResourceCache) -> tuple[object, ...]:
    """`alike`, and where locality LB applies in this snapshot, what of the proxy it reads."""
    keys = cache.per_snapshot(snapshot, ("failover priority labels",), lambda: locality.priority_label_keys(snapshot))
    # With network gateways, assignments differ per network (never per proxy); and by the networks it asks to see.
    in_network = (proxy.network,) if networks(snapshot, cache).network_gateways else ()
    return (alike(snapshot, proxy), *locality.view(snapshot, proxy, keys), *in_network, *proxy.network_view)


def assignments(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    """The assignments themselves, made anew (proxyless clients share them by name instead)."""
    result = []
    mesh = networks(snapshot, cache)
    default_network = network.system_network(snapshot) if mesh.network_gateways or proxy.network_view else ""
    for target in outbound_clusters(snapshot, proxy, names):
        if target.service.dns_resolved:
            continue  # its cluster carries its endpoints (DNS names)
        endpoint_list = snapshot.endpoints_for(target.service.hostname, target.port)
        # A subset's endpoints depend on which rule defines it for this proxy.
        scope = str(target.rule.meta) if target.subset is not None and target.rule is not None else ""
        lb = locality.locality_lb(snapshot.mesh.locality_lb_setting,
                                  effective_policy(target.rule, target.port, target.subset))
        near: tuple[Locality, dict[str, str]] | None = None
        if lb is not None:  # then it is made for the proxy's locality (and failoverPriority labels)
            where = locality.proxy_locality(snapshot, proxy)
            near = where, locality.topology_labels(proxy.labels, where)
            priority = [near[1].get(key.partition("=")[0], "") for key in lb.setting.failover_priority]
            scope = f"{target.rule.meta if target.rule else ''}|{scope}|{where!r}|{priority}"  # repr: every part
        if mesh.network_gateways:
            scope = f"{scope}|network={proxy.network}"
        if proxy.network_view:
            scope = f"{scope}|view={','.join(proxy.network_view)}"
        result.append(cache.get(types.ENDPOINT, target.name,
                                (endpoint_list, target.subset, target.rule, mesh, default_network),
                                lambda: load_assignment(target.name, network.by_network(
                                    subset_endpoints(endpoint_list, target.subset), proxy.network,
                                    mesh, default_network, proxy.network_view), lb, near),
                                scope=scope))
    return result


def networks(snapshot: Snapshot, cache: ResourceCache) -> MeshConfig:
    """The mesh config with the gateways of labelled Services, once per snapshot."""
    return cache.per_snapshot(snapshot, ("network gateways",), lambda: network.with_service_gateways(snapshot))


def load_assignment(cluster_name: str, endpoint_list: tuple[Endpoint, ...], lb: LocalityLb | None = None,
                    near: tuple[Locality, dict[str, str]] | None = None) -> endpoint_pb2.ClusterLoadAssignment:
    """gRPC drops a locality without a locality or with weight 0, so every group gets both. Envoy
    and gRPC take IP addresses only (one bad address would reject the whole assignment). Unready
    endpoints are left out, as istiod does by default (PILOT_SEND_UNHEALTHY_ENDPOINTS off). With
    locality LB, priorities or weights relative to the proxy (`near`: its locality and labels)."""
    assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name)
    usable = [e for e in endpoint_list if e.healthy and is_ip(e.address)]
    by_locality = sorted(usable, key=lambda e: (str(e.locality), e.address, e.port))
    groups = []
    for where, group in groupby(by_locality, key=lambda e: e.locality):
        members = list(group)
        groups.append(members)
        assignment.endpoints.append(
            endpoint_components_pb2.LocalityLbEndpoints(
                locality=base_pb2.Locality(region=where.region, zone=where.zone, sub_zone=where.subzone),
                load_balancing_weight=wrappers_pb2.UInt32Value(value=sum(e.weight or 1 for e in members)),
                lb_endpoints=[_lb_endpoint(e) for e in members],
            )
        )
    if lb is not None and near is not None:
        locality.apply(assignment, groups, lb, *near)
    return assignment


def dns_load_assignment(cluster_name: str, endpoint_list: tuple[Endpoint, ...]) -> endpoint_pb2.ClusterLoadAssignment:
    """The inline endpoints of a DNS cluster: host names the client resolves, in one locality."""
    return endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name, endpoints=[
        endpoint_components_pb2.LocalityLbEndpoints(
            load_balancing_weight=wrappers_pb2.UInt32Value(value=1),
            lb_endpoints=[_lb_endpoint(e) for e in endpoint_list])])


def _lb_endpoint(endpoint: Endpoint) -> endpoint_components_pb2.LbEndpoint:
    tls_mode = dict(endpoint.labels).get(TLS_MODE_LABEL)
    metadata = None
    if tls_mode and tls_mode != "disabled":  # the pod has a sidecar (the injector labels it `istio`); as istiod
        fields = struct_pb2.Struct()
        fields.update({"tlsMode": tls_mode})
        metadata = base_pb2.Metadata(filter_metadata={TRANSPORT_SOCKET_MATCH: fields})
    return endpoint_components_pb2.LbEndpoint(
        metadata=metadata,
        endpoint=endpoint_components_pb2.Endpoint(
            address=address_pb2.Address(
                socket_address=address_pb2.SocketAddress(address=endpoint.address, port_value=endpoint.port)
            )
        ),
        health_status=health_check_pb2.HEALTHY,
        load_balancing_weight=wrappers_pb2.UInt32Value(value=endpoint.weight or 1),
    )


def is_ip(address: str) -> bool:
    """An address Envoy and gRPC accept for an endpoint or a listener."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return "%" not in address  # a scoped IPv6 address means nothing off the node that wrote it

"""CDS and EDS for waypoints, as Istio's cluster_waypoint.go:

- `main_internal`: the internal listener that picks a service's chain by the CONNECT target.
- `inbound-vip|<port>|<http|tcp>[/<subset>]|<host>` per port (and subset) of each service it serves
  and each its routes send to (not every service of the mesh, as istiod): EDS whose
  endpoints are the internal listener `connect_originate`, each carrying its pod address:port as
  `envoy.filters.listener.original_dst` metadata, which the internal upstream hands to that listener.
- `BlackHoleCluster`: where `main_internal` sends what no service's chain takes.
- `connect_originate`: ORIGINAL_DST to the pod's HBONE port 15008, HTTP/2 over mesh mTLS (SDS).
"""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.extensions.transport_sockets.internal_upstream.v3 import internal_upstream_pb2
from envoy.type.metadata.v3 import metadata_pb2
from google.protobuf import struct_pb2, wrappers_pb2

from istiod.model.config.networking import Subset
from istiod.model.protocol import Protocol
from istiod.model.proxy import Proxy
from istiod.model.service import Endpoint
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.eds import load_assignment
from istiod.xds.gen.filters import ads_source, pack
from istiod.xds.gen.policy import subset_endpoints
from istiod.xds.gen.sidecar.clusters import BLACKHOLE, CONNECT_TIMEOUT, _protocol_options, _unlimited, blackhole
from istiod.xds.gen.sidecar.ports import OutboundPort, outbound_ports
from istiod.xds.gen.targets import alike, destination_rule
from istiod.xds.gen.tls import raw_buffer, sds_hbone_upstream_tls
from istiod.xds.gen.waypoint.services import routed_hosts, waypoint_cluster_name

MAIN_INTERNAL = "main_internal"
CONNECT_ORIGINATE = "connect_originate"
HBONE_PORT = 15008
ORIGINAL_DST_METADATA = "envoy.filters.listener.original_dst"  # read by original_dst on an internal listener
INTERNAL_UPSTREAM = "envoy.transport_sockets.internal_upstream"


def clusters(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    result = [cache.get(types.CLUSTER, name, None, build) for name, build in (
        (MAIN_INTERNAL, main_internal), (CONNECT_ORIGINATE, connect_originate), (BLACKHOLE, blackhole))]
    result += cache.per_snapshot(snapshot, ("waypoint clusters", alike(snapshot, proxy)),
                                 lambda: _service_clusters(snapshot, proxy, cache))
    if names is not None:
        wanted = set(names)
        result = [r for r in result if r.name in wanted]
    return result


def _service_clusters(snapshot: Snapshot, proxy: Proxy, cache: ResourceCache) -> list[Resource]:
    result = []
    for name, (target, _) in _targets(snapshot, proxy).items():
        http2 = target.protocol.is_http2
        result.append(cache.get(types.CLUSTER, name, None, lambda: service_cluster(name, http2), scope=str(http2)))
    return result


def _targets(snapshot: Snapshot, proxy: Proxy) -> dict[str, tuple[OutboundPort, str]]:
    """Each cluster name -> (its OutboundPort, its subset name)."""
    made: dict[str, tuple[OutboundPort, str]] = {}
    hosts = routed_hosts(snapshot, proxy)
    for target in outbound_ports(snapshot, proxy):
        if target.service.hostname not in hosts:
            continue
        rule = destination_rule(snapshot, proxy, target.service)
        for subset in ("", *(s.name for s in (rule.subsets if rule is not None else ()))):
            name = waypoint_cluster_name(target.port.port, target.service.hostname, subset, target.protocol.is_http)
            made.setdefault(name, (target, subset))
    return made


def service_cluster(name: str, http2: bool) -> cluster_pb2.Cluster:
    """EDS; its endpoints are `connect_originate` with each pod's address in the metadata passed along."""
    socket = internal_upstream_pb2.InternalUpstreamTransport(
        passthrough_metadata=[internal_upstream_pb2.InternalUpstreamTransport.MetadataValueSource(
            kind=metadata_pb2.MetadataKind(host=metadata_pb2.MetadataKind.Host()), name=ORIGINAL_DST_METADATA)],
        transport_socket=raw_buffer())
    return cluster_pb2.Cluster(
        name=name, type=cluster_pb2.Cluster.EDS, connect_timeout=CONNECT_TIMEOUT, circuit_breakers=_unlimited(),
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=ads_source()),
        transport_socket=base_pb2.TransportSocket(name=INTERNAL_UPSTREAM, typed_config=pack(socket)),
        typed_extension_protocol_options=_protocol_options(Protocol.HTTP2) if http2 else {})


def main_internal() -> cluster_pb2.Cluster:
    """Into the internal listener `main_internal`; the CONNECT target rides along in filter state."""
    return cluster_pb2.Cluster(
        name=MAIN_INTERNAL, type=cluster_pb2.Cluster.STATIC, connect_timeout=CONNECT_TIMEOUT,
        circuit_breakers=_unlimited(),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(cluster_name=MAIN_INTERNAL, endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[_internal_endpoint(MAIN_INTERNAL)])]),
        transport_socket=base_pb2.TransportSocket(name=INTERNAL_UPSTREAM, typed_config=pack(
            internal_upstream_pb2.InternalUpstreamTransport(transport_socket=raw_buffer()))))


def connect_originate() -> cluster_pb2.Cluster:
    """HBONE to the destination pod: its address (from the internal listener's original destination)
    with the port made 15008, HTTP/2 over mTLS with the waypoint's certificate."""
    return cluster_pb2.Cluster(
        name=CONNECT_ORIGINATE, type=cluster_pb2.Cluster.ORIGINAL_DST, lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        connect_timeout=CONNECT_TIMEOUT, circuit_breakers=_unlimited(),
        original_dst_lb_config=cluster_pb2.Cluster.OriginalDstLbConfig(
            upstream_port_override=wrappers_pb2.UInt32Value(value=HBONE_PORT)),
        transport_socket=sds_hbone_upstream_tls(),
        typed_extension_protocol_options=_protocol_options(Protocol.HTTP2))


def endpoints(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    result = []
    targets = _targets(snapshot, proxy)
    for name in sorted(targets) if names is None else [n for n in names if n in targets]:
        target, subset_name = targets[name]
        service, port = target.service, target.port.port
        rule = destination_rule(snapshot, proxy, service)
        subset = next((s for s in (rule.subsets if rule is not None else ()) if s.name == subset_name), None)
        found = snapshot.endpoints_for(service.hostname, port)
        result.append(cache.get(types.ENDPOINT, name, (found, subset), lambda: _assignment(name, found, subset)))
    return result


def _assignment(name: str, found: tuple[Endpoint, ...], subset: Subset | None) -> endpoint_pb2.ClusterLoadAssignment:
    assignment = load_assignment(name, subset_endpoints(found, subset))
    for group in assignment.endpoints:
        for lb_endpoint in group.lb_endpoints:
            socket = lb_endpoint.endpoint.address.socket_address
            target = f"{socket.address}:{socket.port_value}"
            lb_endpoint.endpoint.address.CopyFrom(_internal_address(CONNECT_ORIGINATE, target))
            original = struct_pb2.Struct()
            original.update({"local": target})
            lb_endpoint.metadata.filter_metadata[ORIGINAL_DST_METADATA].CopyFrom(original)
    return assignment


def _internal_endpoint(listener: str) -> endpoint_components_pb2.LbEndpoint:
    return endpoint_components_pb2.LbEndpoint(endpoint=endpoint_components_pb2.Endpoint(
        address=_internal_address(listener)))


def _internal_address(listener: str, endpoint_id: str = "") -> address_pb2.Address:
    return address_pb2.Address(envoy_internal_address=address_pb2.EnvoyInternalAddress(
        server_listener_name=listener, endpoint_id=endpoint_id))

"""Which services a waypoint proxy serves, and the names of its clusters for them (Istio's `inbound-vip`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from envoy.config.route.v3 import route_components_pb2 as rc

from istiod.model.config.networking import ConsistentHash
from istiod.model.config.security import AuthorizationPolicy, RequestAuthentication
from istiod.model.names import parse_cluster_name
from istiod.model.proxy import Proxy
from istiod.model.service import Port, Service
from istiod.model.snapshot import Snapshot
from istiod.xds.gen.routes import http_routes
from istiod.xds.gen.sidecar.ports import outbound_ports
from istiod.xds.gen.targets import hash_lookup, route_inputs
from istiod.xds.gen.ztunnel.addresses import GATEWAY_NAME_LABEL, waypoint_for


@dataclass(frozen=True, slots=True)
class WaypointPort:
    """A port of a service whose traffic this waypoint takes (its ClusterIP: the CONNECT target)."""

    service: Service
    port: Port
    http: bool
    vip: str


def waypoint_cluster_name(port: int, hostname: str, subset: str, http: bool) -> str:
    """Istio's `inbound-vip|<port>|<http|tcp>[/<subset>]|<host>`."""
    kind = "http" if http else "tcp"
    return f"inbound-vip|{port}|{kind}/{subset}|{hostname}" if subset else f"inbound-vip|{port}|{kind}|{hostname}"


def from_outbound(name: str) -> str:
    """The waypoint cluster a route's `outbound|port|subset|host` destination names (route translation is
    the sidecar's); a name of another form is kept."""
    try:
        _, port, subset, host = parse_cluster_name(name)
    except ValueError:
        return name
    return waypoint_cluster_name(port, host, subset, http=True)


def attached_policies(snapshot: Snapshot, proxy: Proxy, service: Service) -> tuple[AuthorizationPolicy, ...]:
    """The AuthorizationPolicies whose targetRefs name this waypoint (its Gateway) or the service."""
    return _attached(snapshot.config.authorization_policies, proxy, service)


def attached_authentications(snapshot: Snapshot, proxy: Proxy, service: Service) -> tuple[RequestAuthentication, ...]:
    """The RequestAuthentications whose targetRefs name this waypoint (its Gateway) or the service."""
    return _attached(snapshot.config.request_authentications, proxy, service)


P = TypeVar("P", AuthorizationPolicy, RequestAuthentication)


def _attached(policies: Iterable[P], proxy: Proxy, service: Service) -> tuple[P, ...]:
    gateway = dict(proxy.labels).get(GATEWAY_NAME_LABEL, "")
    return tuple(p for p in policies
                 if (p.meta.namespace == proxy.namespace and ("Gateway", gateway) in p.target_refs)
                 or (p.meta.namespace == service.namespace and ("Service", service.name) in p.target_refs))


def waypoint_ports(snapshot: Snapshot, proxy: Proxy) -> Iterator[WaypointPort]:
    """The ports of the services that name this proxy's waypoint (its pods' `gateway-name` label, in
    its namespace), as ztunnel is told in WDS; only those with a ClusterIP can be CONNECT targets."""
    waypoint = snapshot.config.gateway_api.waypoints.get((proxy.namespace, dict(proxy.labels).get(GATEWAY_NAME_LABEL, "")))
    if waypoint is None:
        return
    for target in outbound_ports(snapshot, proxy):
        used = waypoint_for(snapshot, target.service.namespace, dict(target.service.labels), "service")
        if (used is not None and used.hostname.hostname == waypoint.hostname
                and used.hostname.namespace == waypoint.meta.namespace and target.vip is not None):
            yield WaypointPort(target.service, target.port, target.protocol.is_http, target.vip)



def service_routes(snapshot: Snapshot, proxy: Proxy, served: WaypointPort,
                   hash_for: Callable[[str, str, int], ConsistentHash | None]) -> list[rc.Route]:
    """A served HTTP port's routes: the sidecar's translation of its VirtualService (or routes with the
    Service as parent), sent to the waypoint's clusters for the same destinations."""
    vs, _ = route_inputs(snapshot, proxy, served.service)
    routes = http_routes(vs, served.service, served.port.port, snapshot.services, hash_for, proxyless=False,
                         source=(proxy.namespace, dict(proxy.labels)))
    for route in routes:
        if route.HasField("route"):
            action = route.route
            if action.cluster:
                action.cluster = from_outbound(action.cluster)
            for weighted in action.weighted_clusters.clusters:
                weighted.name = from_outbound(weighted.name)
            for mirror in action.request_mirror_policies:
                mirror.cluster = from_outbound(mirror.cluster)
    return routes


def routed_hosts(snapshot: Snapshot, proxy: Proxy) -> set[str]:
    """The hosts the waypoint needs clusters for (as istiod's, not every service of the mesh): those of
    the services it serves, and those their routes send or mirror to."""
    hosts = set()
    hash_for = hash_lookup(snapshot, proxy)
    for served in waypoint_ports(snapshot, proxy):
        hosts.add(served.service.hostname)
        if not served.http:
            continue
        for route in service_routes(snapshot, proxy, served, hash_for):
            action = route.route
            for name in (action.cluster, *(w.name for w in action.weighted_clusters.clusters),
                         *(m.cluster for m in action.request_mirror_policies)):
                if name.startswith("inbound-vip|"):
                    hosts.add(name.rsplit("|", 1)[1])
    return hosts

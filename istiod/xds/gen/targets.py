"""Which services a proxy sees, and what requested resource names refer to: (name, Service, port)
triples or cluster targets, or everything the proxy sees for a wildcard. Shared by every flavor."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from istiod.model.config.networking import (
    ConsistentHash, DestinationRule, HTTPRoute, L4Route, Sidecar, Subset, TunnelSettings, VirtualService,
)
from istiod.model.config.scope import egress_allows, exported_to
from istiod.model.mesh import OutboundTrafficPolicy
from istiod.model.names import outbound_cluster_name, parse_cluster_name, split_host_port
from istiod.model.proxy import Proxy
from istiod.model.service import Service
from istiod.model.snapshot import Snapshot
from istiod.xds.gen.policy import effective_policy


@dataclass(frozen=True, slots=True)
class ClusterTarget:
    """An `outbound|port|subset|host` cluster, with the DestinationRule that shapes it for this proxy."""

    name: str
    service: Service
    port: int
    rule: DestinationRule | None = None
    subset: Subset | None = None


def alike(snapshot: Snapshot, proxy: Proxy) -> tuple[str, tuple[tuple[str, str], ...]]:
    """All that this module's lookups read of a proxy: proxies alike in it see the same outbound
    config, so generators share what they make under this key (ResourceCache.per_snapshot). A lookup
    that reads more of a proxy must add it here. Of its labels, only those some config object selects
    by: every sidecar has labels of its own pod (app, pod-template-hash), and keyed by all of them 500
    Envoys had 500 copies of every route configuration made, serialized and held."""
    keys = snapshot.config.selector_keys()
    return proxy.namespace, tuple(label for label in proxy.labels if label[0] in keys)


def sidecar_resource(snapshot: Snapshot, proxy: Proxy) -> Sidecar | None:
    """The Sidecar resource that applies to the proxy, if any (istiod's lookup order)."""
    return snapshot.config.sidecar_for(proxy.namespace, dict(proxy.labels), snapshot.mesh.root_namespace)


def exported(snapshot: Snapshot, service: Service, proxy: Proxy) -> bool:
    """Whether the service is exported to the proxy's namespace: a ServiceEntry's exportTo or a
    Service's `networking.istio.io/exportTo` annotation, else the mesh's defaultServiceExportTo,
    hides it from other namespaces' proxies entirely, even asked for by name, as istiod."""
    return exported_to(service.export_to or snapshot.mesh.default_service_export_to, service.namespace,
                       proxy.namespace)


def visible_services(snapshot: Snapshot, proxy: Proxy, aliases: bool = False) -> Iterable[Service]:
    """The services a proxy sees: those exported to its namespace, and of them, under a Sidecar
    resource, those some egress listener names in `hosts` (what keeps a proxy's config small).
    ExternalName Services (istiod's aliases) have no config of their own: only with `aliases`."""
    sidecar = sidecar_resource(snapshot, proxy)
    seen = [s for s in snapshot.services.values() if (aliases or not s.external_name) and exported(snapshot, s, proxy)]
    if sidecar is None or not sidecar.egress:
        return seen
    return [s for s in seen
            if any(egress_allows(e, sidecar.meta.namespace, s.namespace, s.hostname) for e in sidecar.egress)]


def aliases_of(snapshot: Snapshot, proxy: Proxy) -> dict[str, list[Service]]:
    """The ExternalName Services the proxy sees, by the host they name (istiod's service aliases)."""
    result: dict[str, list[Service]] = {}
    for service in visible_services(snapshot, proxy, aliases=True):
        if service.external_name:
            result.setdefault(service.external_name, []).append(service)
    return result


def outbound_traffic_policy(snapshot: Snapshot, proxy: Proxy) -> OutboundTrafficPolicy:
    """The mesh's, unless the proxy's Sidecar resource sets its own."""
    sidecar = sidecar_resource(snapshot, proxy)
    if sidecar is not None and sidecar.outbound_traffic_policy:
        return OutboundTrafficPolicy(sidecar.outbound_traffic_policy)
    return snapshot.mesh.outbound_traffic_policy


def destination_rule(snapshot: Snapshot, proxy: Proxy, service: Service) -> DestinationRule | None:
    return snapshot.config.destination_rule_for(proxy.namespace, dict(proxy.labels), service.hostname,
                                                service.namespace, snapshot.mesh.root_namespace)


def hash_lookup(snapshot: Snapshot, proxy: Proxy) -> Callable[[str, str, int], ConsistentHash | None]:
    """For route translation: the consistentHash that applies to a destination (host, subset, port)."""
    def consistent_hash(host: str, subset_name: str, port: int) -> ConsistentHash | None:
        service = snapshot.services.get(host)
        rule = destination_rule(snapshot, proxy, service) if service is not None else None
        subset = rule.subset(subset_name) if rule is not None and subset_name else None
        lb = effective_policy(rule, port, subset).load_balancer
        return lb.consistent_hash if lb is not None else None

    return consistent_hash


# For a tcp_proxy to (cluster, weight) destinations: the tunnel it opens to the upstream, if any.
TunnelOf = Callable[[Sequence[tuple[str, int]]], TunnelSettings | None]


def no_tunnel(_: Sequence[tuple[str, int]]) -> TunnelSettings | None:
    return None


def tunnel_lookup(snapshot: Snapshot, proxy: Proxy) -> TunnelOf:
    """istiod's tunnelingconfig.Apply: the DestinationRule of the first destination's host decides;
    to one destination with a subset, the subset's tunnel (none if the subset sets none), else the
    rule's own. A weighted split takes the rule's own: the tunnel is the listener's, not a cluster's."""
    def tunnel(destinations: Sequence[tuple[str, int]]) -> TunnelSettings | None:
        try:
            _, _, subset_name, host = parse_cluster_name(destinations[0][0])
        except ValueError:  # PassthroughCluster, BlackHoleCluster
            return None
        service = snapshot.services.get(host)
        rule = destination_rule(snapshot, proxy, service) if service is not None else None
        if rule is None:
            return None
        if subset_name and len(destinations) == 1:
            subset = rule.subset(subset_name)
            policy = subset.traffic_policy if subset is not None else None
        else:
            policy = rule.traffic_policy
        return policy.tunnel if policy is not None else None

    return tunnel


def route_inputs(snapshot: Snapshot, proxy: Proxy, service: Service) -> tuple[VirtualService | None, tuple[object, ...]]:
    """The VirtualService for a host as this proxy sees it, and what the host's routes depend on
    (for the cache): it, and each destination's Service and DestinationRule. Model values keep
    their identity while unchanged, so an unrelated change rebuilds nothing."""
    vs = snapshot.config.virtual_service_for_host(proxy.namespace, service.hostname)
    routes: list[HTTPRoute | L4Route] = [*vs.http, *vs.tcp, *vs.tls] if vs is not None else []
    mirrors = [m.destination.host for r in vs.http for m in r.mirrors] if vs is not None else []
    hosts = dict.fromkeys([service.hostname, *(d.destination.host for r in routes for d in r.route), *mirrors])
    depends_on: list[object] = [vs]
    for host in hosts:
        destination = snapshot.services.get(host)
        depends_on += [destination, destination_rule(snapshot, proxy, destination) if destination else None]
    return vs, tuple(depends_on)


def outbound_host_ports(snapshot: Snapshot, proxy: Proxy, names: list[str] | None) -> Iterator[tuple[str, Service, int]]:
    """Listener names `host:port` (host in any alias form, or the bare name for a proxy in the
    Service's namespace, as DNS search paths would resolve it) that name a Service port."""
    if names is None:
        names = [f"{s.hostname}:{p.port}" for s in visible_services(snapshot, proxy) for p in s.ports]
    for name in names:
        try:
            host, port = split_host_port(name)
        except ValueError:
            continue
        service = snapshot.service_for_host(host if "." in host else f"{host}.{proxy.namespace}")
        if service is not None and service.port(port) is not None and exported(snapshot, service, proxy):
            yield name, service, port


def outbound_clusters(snapshot: Snapshot, proxy: Proxy, names: list[str] | None) -> Iterator[ClusterTarget]:
    """Cluster names `outbound|port|subset|host` that name a Service port, and for a subset one
    that the proxy's DestinationRule for the host defines; a wildcard gets every subset too."""
    if names is None:
        names = []
        for visible in visible_services(snapshot, proxy):
            defined = destination_rule(snapshot, proxy, visible)
            subsets = [""] + [s.name for s in defined.subsets] if defined is not None else [""]
            names += [outbound_cluster_name(p.port, visible.hostname, subset) for p in visible.ports for subset in subsets]
    for name in names:
        try:
            direction, port, subset_name, host = parse_cluster_name(name)
        except ValueError:
            continue
        service = snapshot.services.get(host)
        if direction != "outbound" or service is None or service.port(port) is None or not exported(snapshot, service, proxy):
            continue
        rule = destination_rule(snapshot, proxy, service)
        subset = rule.subset(subset_name) if rule is not None and subset_name else None
        if subset_name and subset is None:
            continue  # a subset no rule defines: no cluster, as istiod
        yield ClusterTarget(name, service, port, rule, subset)

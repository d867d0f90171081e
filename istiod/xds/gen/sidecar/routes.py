"""RDS for sidecars: route configuration `<port>` for the listener `0.0.0.0_<port>`, and
`<host>:<port>` for the HTTP a sniffed port's listener `<vip>_<port>` finds.

One virtual host `<host>:<port>` per HTTP service on that port, whose domains list every name a
client may use, as Istio's: the FQDN and its absolute form (trailing dot), the bare `name` for
proxies in the same namespace, `name.ns.svc`, `name.ns`, and the ClusterIP. Envoy ignores the Host
header's port (`ignore_port_in_host_matching`), so the domains carry none. Its routes are the VirtualService's, translated as for proxyless gRPC
(istiod/xds/gen/routes.py). Any other host goes to PassthroughCluster (`allow_any`), or gets a 502
(`block_all`) under REGISTRY_ONLY, as istiod does.
"""

from __future__ import annotations

from envoy.config.route.v3 import route_components_pb2, route_pb2
from google.protobuf import wrappers_pb2

from istiod.model.names import join_host_port
from istiod.model.protocol import Protocol
from istiod.model.service import Service
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.routes import default_route, http_routes
from istiod.xds.gen.sidecar.clusters import BLACKHOLE, unmatched_cluster
from istiod.xds.gen.sidecar.listeners import sniffed_route_name
from istiod.xds.gen.sidecar.ports import OutboundPort, outbound_ports
from istiod.xds.gen.targets import aliases_of, alike, hash_lookup, route_inputs

BLOCKED_STATUS = 502


def routes(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    key = ("sidecar routes", alike(snapshot, proxy), None if names is None else tuple(names))
    return list(cache.per_snapshot(snapshot, key, lambda: _routes(snapshot, proxy, names, cache)))


def _routes(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    by_port: dict[int, list[OutboundPort]] = {}
    sniffed: dict[str, OutboundPort] = {}
    for target in outbound_ports(snapshot, proxy):
        if target.protocol.is_http:
            by_port.setdefault(target.number, []).append(target)
        elif target.protocol is Protocol.UNSUPPORTED and (target.bind or target.vip or target.service.headless):
            sniffed.setdefault(sniffed_route_name(target), target)
        elif target.protocol is Protocol.UNSUPPORTED and target.service.external_host:
            # A sniffed port of a host without an address: the wildcard listener's HTTP takes the
            # port's routes, as an HTTP port's (istiod's).
            by_port.setdefault(target.number, []).append(target)
    wanted = sorted(by_port) if names is None else [int(n) for n in names if n.isdigit() and int(n) in by_port]
    aliases = aliases_of(snapshot, proxy)  # ExternalName Services: their names are on the hosts they name
    # The same for every port of this proxy: worked out once.
    alike_key, unmatched = alike(snapshot, proxy), unmatched_cluster(snapshot, proxy)
    result = []
    for name in sorted(sniffed) if names is None else [n for n in names if n in sniffed]:
        target = sniffed[name]
        result.append(cache.get(types.ROUTE, name, route_inputs(snapshot, proxy, target.service)[1],
                                lambda: sniffed_route_configuration(name, target, snapshot, proxy),
                                scope=str(alike_key)))
    for port in wanted:
        targets = by_port[port]
        # Short names differ by the proxy's namespace; VirtualService visibility and the
        # DestinationRules behind hash policies by its namespace and labels.
        # A Sidecar resource changes which services are on the port, and the catch-all.
        depends_on = (snapshot.mesh, *(t.service for t in targets),
                      *(a for t in targets for a in aliases.get(t.service.hostname, ())),
                      *(d for t in targets for d in route_inputs(snapshot, proxy, t.service)[1]))
        result.append(cache.get(types.ROUTE, str(port), depends_on,
                                lambda: route_configuration(port, targets, snapshot, proxy, unmatched),
                                scope=f"{alike_key}/{unmatched}"))
    return result


def route_configuration(port: int, targets: list[OutboundPort], snapshot: Snapshot, proxy: Proxy,
                        unmatched: str) -> route_pb2.RouteConfiguration:
    hosts = []
    taken: set[str] = set()
    hash_for = hash_lookup(snapshot, proxy)
    aliases = aliases_of(snapshot, proxy)
    for target in targets:
        # Envoy refuses a route configuration in which two virtual hosts share a domain (two
        # Services claiming one ClusterIP): the first by hostname keeps it. ExternalName Services
        # naming the host add their names, as istiod's aliases.
        names = _domains(target.service, proxy.namespace)
        for alias in sorted(aliases.get(target.service.hostname, ()), key=lambda s: s.hostname):
            names += _domains(alias, proxy.namespace)
        if (vip := target.vip) is not None:  # a Host header brackets an IPv6 address
            names.append(f"[{vip}]" if ":" in vip else vip)
        domains = [d for d in dict.fromkeys(names) if d not in taken]
        taken.update(domains)
        vs, _ = route_inputs(snapshot, proxy, target.service)
        hosts.append(route_components_pb2.VirtualHost(
            name=join_host_port(target.service.hostname, port),
            domains=domains,
            routes=http_routes(vs, target.service, target.port.port, snapshot.services, hash_for, proxyless=False,
                               source=(proxy.namespace, dict(proxy.labels))),
            include_request_attempt_count=True,
        ))
    if unmatched == BLACKHOLE:
        hosts.append(route_components_pb2.VirtualHost(name="block_all", domains=["*"], routes=[
            route_components_pb2.Route(
                name="block_all", match=route_components_pb2.RouteMatch(prefix="/"),
                direct_response=route_components_pb2.DirectResponseAction(status=BLOCKED_STATUS),
            )]))
    else:
        hosts.append(route_components_pb2.VirtualHost(
            name="allow_any", domains=["*"], routes=[default_route("allow_any", unmatched, proxyless=False)], include_request_attempt_count=True,
        ))
    return route_pb2.RouteConfiguration(
        name=str(port), virtual_hosts=hosts, validate_clusters=wrappers_pb2.BoolValue(value=False),
        ignore_port_in_host_matching=True,
    )


def sniffed_route_configuration(name: str, target: OutboundPort, snapshot: Snapshot,
                                proxy: Proxy) -> route_pb2.RouteConfiguration:
    """The HTTP found on a sniffed port's listener: the service's routes alone, for any Host
    (istiod's route `<host>:<port>`, one virtual host with domain `*`, no catch-all)."""
    vs, _ = route_inputs(snapshot, proxy, target.service)
    host = route_components_pb2.VirtualHost(
        name=join_host_port(target.service.hostname, target.number), domains=["*"],
        routes=http_routes(vs, target.service, target.port.port, snapshot.services, hash_lookup(snapshot, proxy),
                           proxyless=False, source=(proxy.namespace, dict(proxy.labels))),
        include_request_attempt_count=True)
    return route_pb2.RouteConfiguration(name=name, virtual_hosts=[host],
                                        validate_clusters=wrappers_pb2.BoolValue(value=False),
                                        ignore_port_in_host_matching=True)


def _domains(service: Service, namespace: str) -> list[str]:
    fqdn, *short = service.aliases
    names = [fqdn, f"{fqdn}."]
    if service.namespace == namespace and not service.external_host:
        names.append(service.name)
    names += short
    if service.headless:  # a pod by its own name (`web-0.web.shop.svc.cluster.local`), as istiod
        names += [f"*.{name}" for name in names]
    return names

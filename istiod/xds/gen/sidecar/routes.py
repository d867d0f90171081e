"""RDS for sidecars: route configuration `<port>` for the listener `0.0.0.0_<port>`.

One virtual host `<host>:<port>` per HTTP service on that port. Envoy matches the Host header
exactly, port included, so the domains list every name a client may use, with and without the
port: the FQDN, `name.ns.svc`, `name.ns`, the bare `name` for proxies in the same namespace, and
the ClusterIP. Any other host goes to PassthroughCluster (`allow_any`), or gets a 502
(`block_all`) under REGISTRY_ONLY, as istiod does.
"""

from __future__ import annotations

from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from google.protobuf import duration_pb2, wrappers_pb2

from istiod.model.mesh import MeshConfig, OutboundTrafficPolicy
from istiod.model.names import join_host_port
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.filters import pack
from istiod.xds.gen.sidecar.clusters import PASSTHROUGH
from istiod.xds.gen.sidecar.ports import OutboundPort, outbound_ports

BLOCKED_STATUS = 502
PREVIOUS_HOSTS = "envoy.retry_host_predicates.previous_hosts"


def routes(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    by_port: dict[int, list[OutboundPort]] = {}
    for target in outbound_ports(snapshot, proxy):
        if target.protocol.is_http:
            by_port.setdefault(target.port.port, []).append(target)
    wanted = sorted(by_port) if names is None else [int(n) for n in names if n.isdigit() and int(n) in by_port]
    mesh = snapshot.mesh
    result = []
    for port in wanted:
        targets = by_port[port]
        # The same services give the same routes, except for the short names of the proxy's namespace.
        depends_on = (mesh, *(t.service for t in targets))
        result.append(cache.get(types.ROUTE, str(port), depends_on,
                                lambda: route_configuration(port, targets, proxy.namespace, mesh),
                                scope=proxy.namespace))
    return result


def route_configuration(port: int, targets: list[OutboundPort], namespace: str,
                        mesh: MeshConfig) -> route_pb2.RouteConfiguration:
    hosts = []
    taken: set[str] = set()
    for target in targets:
        # Envoy refuses a route configuration in which two virtual hosts share a domain (two
        # Services claiming one ClusterIP): the first by hostname keeps it.
        domains = [d for d in _domains(target, namespace) if d not in taken]
        taken.update(domains)
        hosts.append(route_components_pb2.VirtualHost(
            name=join_host_port(target.service.hostname, port),
            domains=domains,
            routes=[_route("default", target.cluster)],
            include_request_attempt_count=True,
        ))
    if mesh.outbound_traffic_policy is OutboundTrafficPolicy.REGISTRY_ONLY:
        hosts.append(route_components_pb2.VirtualHost(name="block_all", domains=["*"], routes=[
            route_components_pb2.Route(
                name="block_all", match=route_components_pb2.RouteMatch(prefix="/"),
                direct_response=route_components_pb2.DirectResponseAction(status=BLOCKED_STATUS),
            )]))
    else:
        hosts.append(route_components_pb2.VirtualHost(
            name="allow_any", domains=["*"], routes=[_route("allow_any", PASSTHROUGH)], include_request_attempt_count=True,
        ))
    return route_pb2.RouteConfiguration(
        name=str(port), virtual_hosts=hosts, validate_clusters=wrappers_pb2.BoolValue(value=False)
    )


def _domains(target: OutboundPort, namespace: str) -> list[str]:
    service, port = target.service, target.port.port
    names = list(service.aliases)
    if service.namespace == namespace:
        names.append(service.name)
    domains = [domain for name in names for domain in (name, join_host_port(name, port))]
    if (vip := target.vip) is not None:  # a Host header brackets an IPv6 address
        domains += [f"[{vip}]" if ":" in vip else vip, join_host_port(vip, port)]
    return domains


def _route(name: str, cluster: str) -> route_components_pb2.Route:
    return route_components_pb2.Route(
        name=name,
        match=route_components_pb2.RouteMatch(prefix="/"),
        # No route timeout, as istiod's default (Envoy's would be 15 s).
        route=route_components_pb2.RouteAction(cluster=cluster, timeout=duration_pb2.Duration(),
                                               retry_policy=_default_retries()),
    )


def _default_retries() -> route_components_pb2.RetryPolicy:
    """istiod's default: twice, on another endpoint, when a connection fails or is refused (an
    endpoint that just went away) or the upstream answers 503."""
    return route_components_pb2.RetryPolicy(
        retry_on="connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
        num_retries=wrappers_pb2.UInt32Value(value=2),
        retry_host_predicate=[route_components_pb2.RetryPolicy.RetryHostPredicate(
            name=PREVIOUS_HOSTS, typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()))],
        host_selection_retry_max_attempts=5,
        retriable_status_codes=[503],
    )

"""RDS for gateways: a route configuration per plaintext port (`http.<port>`) and per HTTPS server.

A virtual host `<host>:<port>` per host of a VirtualService bound to the server's Gateway; its
domains are the host with and without any port (`host`, `host:*`), since a client names the
gateway's port in the Host header. Routes are the VirtualService's, translated as for every flavor
(istiod/xds/gen/routes.py), keeping the matches meant for this Gateway. Any other host gets Envoy's
404, as from istiod's gateways.
"""

from __future__ import annotations

from envoy.config.route.v3 import route_components_pb2, route_pb2
from google.protobuf import wrappers_pb2

from istiod.model.names import join_host_port
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.gateway.servers import GatewayServer, bound_hosts, servers_by
from istiod.xds.gen.routes import virtual_service_routes
from istiod.xds.gen.targets import destination_rule, hash_lookup


def routes(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    result = []
    for name, group in servers_by(snapshot, proxy, lambda s: s.route_name):
        if names is not None and name not in names:
            continue
        # Match sources and VirtualService visibility differ by the proxy's namespace and labels.
        result.append(cache.get(types.ROUTE, name, _inputs(snapshot, proxy, group),
                                lambda: route_configuration(name, group, snapshot, proxy),
                                scope=f"{proxy.namespace}/{proxy.labels}"))
    return result


def _inputs(snapshot: Snapshot, proxy: Proxy, servers: tuple[GatewayServer, ...]) -> tuple[object, ...]:
    """What the routes depend on, for the cache: the Gateways, the VirtualServices bound to them, and
    each destination's Service (default ports) and DestinationRule (hash policies)."""
    found: list[object] = list(dict.fromkeys(s.gateway for s in servers))
    for vs in dict.fromkeys(vs for s in servers for _, vs in bound_hosts(snapshot, proxy, s)):
        found.append(vs)
        for host in dict.fromkeys([*(d.destination.host for http in vs.http for d in http.route),
                                   *(m.destination.host for http in vs.http for m in http.mirrors)]):
            service = snapshot.services.get(host)
            found += [service, destination_rule(snapshot, proxy, service) if service is not None else None]
    return tuple(found)


def route_configuration(name: str, servers: tuple[GatewayServer, ...], snapshot: Snapshot,
                        proxy: Proxy) -> route_pb2.RouteConfiguration:
    hash_for = hash_lookup(snapshot, proxy)
    hosts: list[route_components_pb2.VirtualHost] = []
    taken: set[str] = set()
    for served in servers:
        for host, vs in bound_hosts(snapshot, proxy, served):
            # One host, one virtual host: Envoy refuses a domain twice; the first Gateway and
            # VirtualService (by namespace and name) keep it.
            if host in taken:
                continue
            taken.add(host)
            hosts.append(route_components_pb2.VirtualHost(
                name=join_host_port(host, served.port),
                domains=[host] if host.startswith("*") else [host, f"{host}:*"],
                routes=virtual_service_routes(vs, served.port, snapshot.services, hash_for, proxyless=False,
                                              source=(proxy.namespace, dict(proxy.labels)), gateways=(served.ref,)),
                include_request_attempt_count=True,
                require_tls=route_components_pb2.VirtualHost.ALL if served.https_redirect else None,
            ))
    return route_pb2.RouteConfiguration(name=name, virtual_hosts=hosts,
                                        validate_clusters=wrappers_pb2.BoolValue(value=False))

"""Generators: (snapshot, proxy, requested names) -> resources. Pure apart from the shared cache.

`names` is None for a wildcard subscription (every resource of the type the proxy may see).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from istiod.model.names import INBOUND_LISTENER_PREFIX
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen import eds, grpc
from istiod.xds.gen.accesslog import logged
from istiod.xds.gen.envoyfilter import patched
from istiod.xds.gen.generator import Generator
from istiod.xds.gen.gateway import clusters as gateway_clusters
from istiod.xds.gen.gateway import listeners as gateway_listeners
from istiod.xds.gen.gateway import routes as gateway_routes
from istiod.xds.gen.gateway import secrets as gateway_secrets
from istiod.xds.gen.sidecar import clusters, listeners, routes
from istiod.xds.gen.targets import alike
from istiod.xds.gen.waypoint import GENERATORS as WAYPOINT
from istiod.xds.gen.ztunnel import GENERATORS as ZTUNNEL



def shared_by_name(generate: Generator,
                   alike_by: Callable[[Snapshot, Proxy, ResourceCache], object] = lambda s, p, _: alike(s, p)) -> Generator:
    """`generate` with what it makes of each name made once per snapshot for every proxy of the same
    namespace and labels. For proxyless clients, which name what they watch, an outbound resource
    depends on nothing else of the proxy (the Services exported to its namespace and the bare names
    there, its Sidecar, DestinationRule and VirtualService, its routes' source): in a connect storm, or
    a push that wakes thousands of clients watching a few names each, most are asked for again and
    again. Inbound listeners (the proxy's addresses and policies) and wildcards are made as before.
    `alike_by` names what else of the proxy a type reads (EDS: its locality, where locality LB applies)."""
    def generate_shared(snapshot: Snapshot, proxy: Proxy, names: list[str] | None,
                        cache: ResourceCache) -> list[Resource]:
        if names is None:
            return generate(snapshot, proxy, names, cache)
        made: dict[str, Resource] = cache.per_snapshot(snapshot, (generate, alike_by(snapshot, proxy, cache)), dict)
        result, inbound = [], []
        for name in names:
            if name.startswith(INBOUND_LISTENER_PREFIX):
                inbound.append(name)
                continue
            resource = made.get(name)
            if resource is None:  # at most one resource per name; none for a name that names nothing this proxy sees
                resource = next(iter(generate(snapshot, proxy, [name], cache)), None)
                if resource is None:
                    # Not remembered: names a client makes up would outlive its stream here, until the
                    # next snapshot (in a quiet mesh, for good).
                    continue
                made[name] = resource
            result.append(resource)
        return result + generate(snapshot, proxy, inbound, cache) if inbound else result

    return generate_shared


PROXYLESS_GRPC: dict[str, Generator] = {
    types.LISTENER: shared_by_name(grpc.listeners),
    types.ROUTE: shared_by_name(grpc.routes),
    types.CLUSTER: shared_by_name(grpc.clusters),
    types.ENDPOINT: shared_by_name(eds.assignments, eds.alike_for_eds),
}
SIDECAR: dict[str, Generator] = {
    types.CLUSTER: patched(types.CLUSTER, clusters.clusters),
    types.ENDPOINT: eds.endpoints,
    types.LISTENER: patched(types.LISTENER, logged(listeners.listeners)),
    types.ROUTE: patched(types.ROUTE, routes.routes),
    types.SECRET: gateway_secrets.secrets,  # a DestinationRule's credentialName
}
ROUTER: dict[str, Generator] = {
    types.CLUSTER: patched(types.CLUSTER, gateway_clusters.clusters),
    types.ENDPOINT: eds.endpoints,
    types.LISTENER: patched(types.LISTENER, logged(gateway_listeners.listeners)),
    types.ROUTE: patched(types.ROUTE, gateway_routes.routes),
    types.SECRET: gateway_secrets.secrets,
}


_EVERY_TYPE = frozenset(types.PUSH_ORDER)
# What a change of each kind of config (or "Secret": a gateway's credentials) can alter, by flavor:
# the types whose generators read it (istiod's per-generator skipped configs). ServiceEntries and
# WorkloadEntries act through the services and endpoints they make, which are compared on their own.
Affected = dict[str, frozenset[str]]
_NONE: frozenset[str] = frozenset()
_PROXYLESS_AFFECTED: Affected = {
    "VirtualService": frozenset({types.ROUTE}),
    # Subsets decide clusters and their endpoints; consistent hashing and routes' destinations, routes.
    "DestinationRule": frozenset({types.CLUSTER, types.ENDPOINT, types.ROUTE}),
    "Sidecar": _EVERY_TYPE,  # what the proxy sees at all
    "PeerAuthentication": frozenset({types.LISTENER}),  # inbound listeners only
    "AuthorizationPolicy": frozenset({types.LISTENER}),
    "RequestAuthentication": frozenset({types.LISTENER}),
    "Gateway": _NONE, "ServiceEntry": _NONE, "WorkloadEntry": _NONE, "Secret": _NONE,
    "WorkloadGroup": _NONE,  # read by auto-registration only
    "ProxyConfig": _NONE,  # read by injection and the agent, by no generator
    "EnvoyFilter": _NONE,  # applied to Envoys' config only (sidecars and gateways)
    "ConfigMap": _NONE,  # Gateways' parameters: their deployment and status
    "BackendTLSPolicy": _NONE,  # acts through the DestinationRules it makes ("DestinationRule" then)
    "XBackendTrafficPolicy": _NONE,  # likewise
}
_SIDECAR_AFFECTED: Affected = {
    **_PROXYLESS_AFFECTED,
    # TCP listeners carry their routes.
    "VirtualService": frozenset({types.LISTENER, types.ROUTE}),
    "DestinationRule": frozenset({types.CLUSTER, types.ENDPOINT, types.LISTENER, types.ROUTE}),
    "Secret": frozenset({types.SECRET}),
    "ConfigMap": frozenset({types.SECRET}),  # a BackendTLSPolicy's CA
    "EnvoyFilter": frozenset({types.CLUSTER, types.LISTENER, types.ROUTE}),
}
_ROUTER_AFFECTED: Affected = {
    **dict.fromkeys(_PROXYLESS_AFFECTED, _EVERY_TYPE),
    "Secret": frozenset({types.SECRET}), "ConfigMap": frozenset({types.SECRET}),  # (a BackendTLSPolicy's CA)
    "ServiceEntry": _NONE, "WorkloadEntry": _NONE, "ProxyConfig": _NONE, "WorkloadGroup": _NONE,
    "BackendTLSPolicy": _NONE, "XBackendTrafficPolicy": _NONE,
    "EnvoyFilter": frozenset({types.CLUSTER, types.LISTENER, types.ROUTE}),
}
# ztunnel: policies name workloads' policies (Address) and are sent themselves; ServiceEntries and
# WorkloadEntries are workloads and services of their own.
_ZTUNNEL_AFFECTED: Affected = {
    **dict.fromkeys(_PROXYLESS_AFFECTED, _NONE),
    "AuthorizationPolicy": frozenset({types.ADDRESS, types.AUTHORIZATION}),
    "PeerAuthentication": frozenset({types.ADDRESS, types.AUTHORIZATION}),
    "ServiceEntry": frozenset({types.ADDRESS}), "WorkloadEntry": frozenset({types.ADDRESS}),
}
# Waypoints: which services use them, and so every listener and cluster, follows most config.
_WAYPOINT_AFFECTED: Affected = {**dict.fromkeys(_PROXYLESS_AFFECTED, _EVERY_TYPE), "Secret": _NONE, "ProxyConfig": _NONE,
                                 "WorkloadGroup": _NONE, "ConfigMap": _NONE, "BackendTLSPolicy": _NONE,
                                 "XBackendTrafficPolicy": _NONE, "EnvoyFilter": _NONE}
_GENERATORS = {"grpc": PROXYLESS_GRPC, "sidecar": SIDECAR, "router": ROUTER, "ztunnel": ZTUNNEL, "waypoint": WAYPOINT}
_AFFECTED = {"grpc": _PROXYLESS_AFFECTED, "sidecar": _SIDECAR_AFFECTED, "router": _ROUTER_AFFECTED,
             "ztunnel": _ZTUNNEL_AFFECTED, "waypoint": _WAYPOINT_AFFECTED}


def affected_types(proxy: Proxy, kinds: Iterable[str]) -> frozenset[str]:
    """The types of the proxy's config that a change of these kinds can alter (an unknown kind: all)."""
    affected = _AFFECTED.get(_flavor(proxy), {})
    return frozenset().union(*(affected.get(kind, _EVERY_TYPE) for kind in kinds))


def generators_for(proxy: Proxy) -> dict[str, Generator]:
    """By the node's GENERATOR metadata, then its type, as istiod picks."""
    return _GENERATORS.get(_flavor(proxy), {})


def _flavor(proxy: Proxy) -> str:
    return "grpc" if proxy.proxyless else proxy.type

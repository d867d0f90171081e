"""Generators: (snapshot, proxy, requested names) -> resources. Pure apart from the shared cache.

`names` is None for a wildcard subscription (every resource of the type the proxy may see).
"""

from __future__ import annotations

from collections.abc import Callable

from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen import eds, grpc
from istiod.xds.gen.gateway import clusters as gateway_clusters
from istiod.xds.gen.gateway import listeners as gateway_listeners
from istiod.xds.gen.gateway import routes as gateway_routes
from istiod.xds.gen.gateway import secrets as gateway_secrets
from istiod.xds.gen.sidecar import clusters, listeners, routes

Generator = Callable[[Snapshot, Proxy, list[str] | None, ResourceCache], list[Resource]]

PROXYLESS_GRPC: dict[str, Generator] = {
    types.LISTENER: grpc.listeners,
    types.ROUTE: grpc.routes,
    types.CLUSTER: grpc.clusters,
    types.ENDPOINT: eds.endpoints,
}
SIDECAR: dict[str, Generator] = {
    types.CLUSTER: clusters.clusters,
    types.ENDPOINT: eds.endpoints,
    types.LISTENER: listeners.listeners,
    types.ROUTE: routes.routes,
}
ROUTER: dict[str, Generator] = {
    types.CLUSTER: gateway_clusters.clusters,
    types.ENDPOINT: eds.endpoints,
    types.LISTENER: gateway_listeners.listeners,
    types.ROUTE: gateway_routes.routes,
    types.SECRET: gateway_secrets.secrets,
}


def generators_for(proxy: Proxy) -> dict[str, Generator]:
    """By the node's GENERATOR metadata, then its type, as istiod picks. Waypoints and ztunnel are
    not served yet: they get no generator, and so no config, rather than config meant for someone else."""
    if proxy.proxyless:
        return PROXYLESS_GRPC
    if proxy.type == "sidecar":
        return SIDECAR
    if proxy.type == "router":
        return ROUTER
    return {}

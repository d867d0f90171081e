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


def generators_for(proxy: Proxy) -> dict[str, Generator]:
    """By the node's GENERATOR metadata, then its type, as istiod picks. Gateways (`router`),
    waypoints and ztunnel are not served yet: they get no generator, and so no config, rather
    than config meant for someone else."""
    if proxy.proxyless:
        return PROXYLESS_GRPC
    if proxy.type == "sidecar":
        return SIDECAR
    return {}

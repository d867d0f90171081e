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

Generator = Callable[[Snapshot, Proxy, list[str] | None, ResourceCache], list[Resource]]

PROXYLESS_GRPC: dict[str, Generator] = {
    types.LISTENER: grpc.listeners,
    types.ROUTE: grpc.routes,
    types.CLUSTER: grpc.clusters,
    types.ENDPOINT: eds.endpoints,
}


def generators_for(proxy: Proxy) -> dict[str, Generator]:
    """Proxyless gRPC is the only flavor so far; Envoy and ztunnel generators will key off proxy."""
    return PROXYLESS_GRPC

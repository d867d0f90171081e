"""The waypoint flavor of Envoy config: HBONE in, the services' L7 routes, HBONE out to the pods."""

from collections.abc import Callable

from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.waypoint import clusters, listeners

GENERATORS: dict[str, Callable[[Snapshot, Proxy, list[str] | None, ResourceCache], list[Resource]]] = {
    types.CLUSTER: clusters.clusters,
    types.ENDPOINT: clusters.endpoints,
    types.LISTENER: listeners.listeners,
}

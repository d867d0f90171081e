"""The waypoint flavor of Envoy config: HBONE in, the services' L7 routes, HBONE out to the pods."""

from istiod.xds import types
from istiod.xds.gen.waypoint import clusters, listeners

GENERATORS = {
    types.CLUSTER: clusters.clusters,
    types.ENDPOINT: clusters.endpoints,
    types.LISTENER: listeners.listeners,
}

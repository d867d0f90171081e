"""xDS type URLs and their short names (as istiod and istioctl print them)."""

from __future__ import annotations

LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
# SDS: the workload's own certificates come from the agent; a gateway's `kubernetes://` credentials from istiod.
SECRET = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
# ztunnel's workload discovery (WDS): workloads and services by address, and the policies it enforces.
ADDRESS = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION = "type.googleapis.com/istio.security.Authorization"
# Not a resource: a workload's agent reports its readiness probe's result in a request of this type.
HEALTH_INFO = "type.googleapis.com/istio.v1.HealthInformation"

SHORT_NAMES = {CLUSTER: "cds", LISTENER: "lds", ROUTE: "rds", ENDPOINT: "eds", SECRET: "sds",
               ADDRESS: "wads", AUTHORIZATION: "wdsauthorization"}
# The order istiod pushes in, so a client never sees a reference before what it refers to.
PUSH_ORDER = (CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, ADDRESS, AUTHORIZATION)


def short_name(type_url: str) -> str:
    return SHORT_NAMES.get(type_url, type_url.rsplit(".", 1)[-1])

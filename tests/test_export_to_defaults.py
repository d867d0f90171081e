"""meshConfig defaultVirtualServiceExportTo and defaultDestinationRuleExportTo: VirtualServices and
DestinationRules without exportTo take the mesh's, for sidecars, gateways and proxyless gRPC alike,
and another mesh config re-evaluates what each proxy sees (tests/test_proxyless_export_to.py proves
it with a real gRPC client)."""

from __future__ import annotations

from typing import Any

import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.route.v3 import route_pb2

from istiod.model.builder import build_snapshot
from istiod.model.mesh import MeshConfig
from istiod.model.proxy import proxy_from_node
from istiod.model.snapshot import Snapshot
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import PROXYLESS_GRPC, ROUTER, SIDECAR
from tests.conftest import DATA, render
from tests.test_gateway_gen import _l4_gateway

WEB = "web.shop.svc.cluster.local"
# A VirtualService of another namespace for shop's web (a 7s timeout), and a DestinationRule of
# web's own namespace (a connection limit of 7).
OBJECTS = f"""
apiVersion: v1
kind: Namespace
metadata: {{name: billing}}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: web-timeout, namespace: billing}}
spec:
  hosts: [{WEB}]
  http: [{{timeout: 7s, route: [{{destination: {{host: {WEB}}}}}]}}]
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {{name: web-limit, namespace: shop}}
spec:
  host: web
  trafficPolicy: {{connectionPool: {{tcp: {{maxConnections: 7}}}}}}
"""


def node(namespace: str, kind: str = "sidecar") -> str:
    return f"{kind}~127.0.0.50~x-1.{namespace}~{namespace}.svc.cluster.local"


def snapshot(mesh: MeshConfig = MeshConfig(), extra: str = "", previous: Snapshot | None = None) -> Snapshot:
    store = Store()
    for document in yaml.safe_load_all("\n---\n".join([(DATA / "sidecar-mesh.yaml").read_text(), OBJECTS, extra])):
        if document:
            store.apply(document)
    return build_snapshot(store, "v1", mesh=mesh) if previous is None else build_snapshot(store, "v2", previous, [], mesh)


def timeout(snap: Snapshot, namespace: str, generators: Any = SIDECAR, name: str = "80") -> int:
    """The seconds of web's route timeout as a proxy of `namespace` is sent it (0: none)."""
    proxy = proxy_from_node(node(namespace), {})
    (resource,) = generators[types.ROUTE](snap, proxy, [name], ResourceCache())
    config = route_pb2.RouteConfiguration.FromString(resource.value)
    host = next(h for h in config.virtual_hosts if h.name.startswith(WEB))
    route = host.routes[0].route
    return int(route.timeout.seconds or route.max_stream_duration.max_stream_duration.seconds)


def max_connections(snap: Snapshot, namespace: str) -> int:
    """web's connection limit as a proxy of `namespace` is sent it (Istio's default 2^32-1 without the rule)."""
    proxy = proxy_from_node(node(namespace), {})
    clusters = {r.name: cluster_pb2.Cluster.FromString(r.value)
                for r in SIDECAR[types.CLUSTER](snap, proxy, None, ResourceCache())}
    return clusters[f"outbound|80||{WEB}"].circuit_breakers.thresholds[0].max_connections.value


def test_virtual_services_without_export_to_take_the_mesh_default() -> None:
    assert timeout(snapshot(), "shop") == timeout(snapshot(), "billing") == 7  # Istio's default: `*`
    private = snapshot(MeshConfig(default_virtual_service_export_to=(".",)))
    assert timeout(private, "shop") == 0 and timeout(private, "billing") == 7
    named = snapshot(MeshConfig(default_virtual_service_export_to=("shop",)))
    assert timeout(named, "shop") == 7 and timeout(named, "billing") == 0
    # The object's own exportTo wins over the default.
    own = snapshot(MeshConfig(default_virtual_service_export_to=(".",)),
                   OBJECTS.split("---")[1].replace("spec:", "spec:\n  exportTo: ['*']").replace("web-timeout", "public"))
    assert timeout(own, "shop") == 7


def test_proxyless_grpc_sees_as_sidecars_do() -> None:
    name = f"outbound|80||{WEB}"  # gRPC asks for the route configuration by the cluster's name
    private = snapshot(MeshConfig(default_virtual_service_export_to=(".",)))
    assert timeout(snapshot(), "shop", PROXYLESS_GRPC, name) == 7
    assert timeout(private, "shop", PROXYLESS_GRPC, name) == 0


def test_destination_rules_without_export_to_take_the_mesh_default() -> None:
    assert max_connections(snapshot(), "billing") == max_connections(snapshot(), "shop") == 7
    private = snapshot(MeshConfig(default_destination_rule_export_to=(".",)))
    assert max_connections(private, "billing") != 7 and max_connections(private, "shop") == 7
    # istiod honours only `.`: any other default leaves the rule exported everywhere.
    assert max_connections(snapshot(MeshConfig(default_destination_rule_export_to=("shop",))), "billing") == 7


def test_another_mesh_default_re_evaluates_a_snapshot_built_on_the_last() -> None:
    before = snapshot()
    private = snapshot(MeshConfig(default_virtual_service_export_to=(".",), default_destination_rule_export_to=(".",)),
                       previous=before)
    assert timeout(private, "shop") == 0 and max_connections(private, "billing") != 7
    again = snapshot(MeshConfig(), previous=private)
    assert timeout(again, "shop") == 7 and max_connections(again, "billing") == 7


def test_a_gateway_sees_virtual_services_of_other_namespaces_as_the_default_says() -> None:
    """As istiod: the default applies to a VirtualService bound to a Gateway of another namespace too."""
    gateway = _l4_gateway({"port": {"number": 9000, "name": "tcp", "protocol": "TCP"}, "hosts": ["shop/*"]})
    route = {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": "l4", "namespace": "shop"},
             "spec": {"hosts": ["*"], "gateways": ["istio-ingress/l4"],
                      "tcp": [{"route": [{"destination": {"host": "web"}}]}]}}
    store = Store()
    for document in [*yaml.safe_load_all(render("gateway-mesh.yaml", app_ip="127.0.0.61", app_port=8080, bind="127.0.0.60",
                                                http_port=8080, https_port=8443)), gateway, route]:
        store.apply(document)
    proxy = proxy_from_node(node("istio-ingress", "router"), {"LABELS": {"istio": "ingressgateway"}})

    def listeners(mesh: MeshConfig) -> set[str]:
        return {r.name for r in ROUTER[types.LISTENER](build_snapshot(store, "v1", mesh=mesh), proxy, None, ResourceCache())}

    assert "127.0.0.60_9000" in listeners(MeshConfig())
    assert "127.0.0.60_9000" not in listeners(MeshConfig(default_virtual_service_export_to=(".",)))
    assert "127.0.0.60_9000" in listeners(MeshConfig(default_virtual_service_export_to=("istio-ingress",)))

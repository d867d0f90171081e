"""GAMMA without a cluster: an HTTPRoute or GRPCRoute whose parentRef is a Service routes the mesh's
traffic to that Service, through the same lookup and translation as a VirtualService; its status
parents as istiod writes them. Real Envoy and gRPC clients: tests/test_envoy_routing.py,
tests/test_proxyless_routing.py."""

from __future__ import annotations

from typing import Any

from istiod.model.config.networking import MESH_GATEWAY
from istiod.model.snapshot import Snapshot
from tests.test_gateway_api import GROUP, _route_conditions, _snapshot

ECHO = "echo.shop.svc.cluster.local"


def _mesh_route(name: str, namespace: str, *parent: dict[str, Any], kind: str = "HTTPRoute",
                backends: tuple[tuple[str, int], ...] = (("echo-v1", 80), ("echo-v2", 20))) -> dict[str, Any]:
    refs = [{"name": b, "namespace": "shop", "port": 8080, "weight": w} for b, w in backends]
    return {"apiVersion": f"{GROUP}/v1", "kind": kind, "metadata": {"name": name, "namespace": namespace},
            "spec": {"parentRefs": list(parent) or [{"group": "", "kind": "Service", "name": "echo"}],
                     "rules": [{"backendRefs": refs}]}}


def _namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def _hosts(snapshot: Snapshot, namespace: str) -> list[tuple[str, int]] | None:
    vs = snapshot.config.virtual_service_for_host(namespace, ECHO)
    if vs is None:
        return None
    return [(d.destination.host.split(".")[0], d.weight) for r in vs.http for d in r.route]


def test_a_route_on_a_service_is_a_mesh_virtual_service_for_its_host() -> None:
    snapshot = _snapshot(_mesh_route("split", "shop"))
    [vs] = snapshot.config.gateway_api.mesh_virtual_services
    assert (vs.meta.namespace, vs.meta.name, vs.hosts, vs.gateways) == ("shop", f"shop~{ECHO}", (ECHO,),
                                                                        (MESH_GATEWAY,))
    assert vs.gateway_semantics
    assert _hosts(snapshot, "shop") == [("echo-v1", 80), ("echo-v2", 20)]
    assert _hosts(snapshot, "elsewhere") == [("echo-v1", 80), ("echo-v2", 20)]  # the producer's: every client
    assert vs not in snapshot.config.gateway_api.virtual_services  # no Gateway serves it
    assert _route_conditions(snapshot.config.gateway_api, "shop", "split") == {
        "Accepted": ("True", "Accepted", "Route was valid"),
        "ResolvedRefs": ("True", "ResolvedRefs", "All references resolved"),
        # istiod's with ambient on: neither the Service nor its namespace names a waypoint
        "ResolvedWaypoints": ("True", "ResolvedWaypoints", "istio.io/use-waypoint label missing from parent and "
                              "parent namespace; in ambient mode, route will not be respected")}
    parent = snapshot.config.gateway_api.statuses[("HTTPRoute", "shop", "split")]["parents"][0]
    assert parent["controllerName"] == "istio.io/gateway-controller"
    assert parent["parentRef"] == {"group": "", "kind": "Service", "name": "echo"}


def test_a_consumer_route_applies_to_its_namespace_only_and_before_the_producers() -> None:
    consumer = _mesh_route("mine", "client", {"group": "", "kind": "Service", "name": "echo", "namespace": "shop"},
                           backends=(("echo-v2", 1),))
    snapshot = _snapshot(_namespace("client"), _mesh_route("split", "shop"), consumer)
    assert _hosts(snapshot, "client") == [("echo-v2", 0)]
    assert _hosts(snapshot, "shop") == [("echo-v1", 80), ("echo-v2", 20)]
    assert _hosts(snapshot, "third") == [("echo-v1", 80), ("echo-v2", 20)]
    # Without the producer's route, another namespace's clients see no route at all.
    alone = _snapshot(_namespace("client"), consumer)
    assert _hosts(alone, "third") is None and _hosts(alone, "client") == [("echo-v2", 0)]


def _virtual_service(export_to: list[str] | None = None, namespace: str = "shop") -> dict[str, Any]:
    spec: dict[str, Any] = {"hosts": [ECHO], "http": [{"route": [{"destination": {"host": "echo-v1.shop.svc.cluster.local"}}]}]}
    if export_to is not None:
        spec["exportTo"] = export_to
    return {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
            "metadata": {"name": "echo-vs", "namespace": namespace}, "spec": spec}


def test_precedence_against_a_virtual_service_for_the_same_host() -> None:
    # A route on the Service before a VirtualService every namespace sees...
    snapshot = _snapshot(_virtual_service(), _mesh_route("split", "shop", backends=(("echo-v2", 1),)))
    assert _hosts(snapshot, "shop") == [("echo-v2", 0)]
    assert _hosts(snapshot, "other") == [("echo-v2", 0)]
    # ...but after one exported to the proxy's namespace by name (istiod's private index first).
    snapshot = _snapshot(_virtual_service(["."]), _mesh_route("split", "shop", backends=(("echo-v2", 1),)))
    assert _hosts(snapshot, "shop") == [("echo-v1", 0)]
    assert _hosts(snapshot, "other") == [("echo-v2", 0)]
    # Without a route on the Service, the VirtualService as before.
    assert _hosts(_snapshot(_virtual_service()), "shop") == [("echo-v1", 0)]


def test_a_parent_port_restricts_the_rules_to_it() -> None:
    snapshot = _snapshot(_mesh_route("split", "shop", {"group": "", "kind": "Service", "name": "echo", "port": 8080}))
    [vs] = snapshot.config.gateway_api.mesh_virtual_services
    assert {m.port for r in vs.http for m in r.match} == {8080}
    parent = snapshot.config.gateway_api.statuses[("HTTPRoute", "shop", "split")]["parents"][0]
    assert parent["parentRef"]["port"] == 8080


def test_a_grpc_route_on_a_service() -> None:
    snapshot = _snapshot(_mesh_route("rpc", "shop", kind="GRPCRoute"))
    assert _hosts(snapshot, "shop") == [("echo-v1", 80), ("echo-v2", 20)]
    assert _route_conditions(snapshot.config.gateway_api, "shop", "rpc", kind="GRPCRoute")["Accepted"][0] == "True"


def test_a_service_parent_that_cannot_attach_says_why_and_routes_nothing() -> None:
    cases: dict[str, tuple[dict[str, Any], tuple[str, str, str]]] = {
        "gone": ({"group": "", "kind": "Service", "name": "nope"}, ("False", "NoMatchingParent",
                                                                      'parent service: "nope" not found')),
        "port": ({"group": "", "kind": "Service", "name": "echo", "port": 9999},
                 ("False", "NoMatchingParent", "parent service shop/echo has no port 9999")),
        "section": ({"group": "", "kind": "Service", "name": "echo", "sectionName": "http"},
                    ("False", "UnsupportedValue",
                     "sectionName on a Service parentRef is not implemented by this istiod (port is)")),
    }
    snapshot = _snapshot(*(_mesh_route(name, "shop", parent) for name, (parent, _) in cases.items()))
    assert snapshot.config.gateway_api.mesh_virtual_services == ()
    for name, (_, accepted) in cases.items():
        assert _route_conditions(snapshot.config.gateway_api, "shop", name)["Accepted"] == accepted
    # A backend that is not there: the rule answers 500 and ResolvedRefs says why.
    missing = _snapshot(_mesh_route("gone", "shop", backends=(("nope", 1),)))
    conditions = _route_conditions(missing.config.gateway_api, "shop", "gone")
    assert conditions["Accepted"][0] == "True" and conditions["ResolvedRefs"][1] == "BackendNotFound"
    vs = missing.config.virtual_service_for_host("shop", ECHO)
    assert vs is not None and vs.http[0].direct_response is not None and vs.http[0].direct_response.status == 500


def test_mesh_backends_need_no_reference_grant_but_a_gateways_do() -> None:
    """As istiod (enforceRefGrant only for Gateway parents): one route on both parents."""
    route = _mesh_route("both", "client", {"group": "", "kind": "Service", "name": "echo", "namespace": "shop"},
                        {"name": "web", "namespace": "istio-ingress", "sectionName": "http"}, backends=(("echo-v2", 1),))
    snapshot = _snapshot(_namespace("client"), route)
    assert _route_conditions(snapshot.config.gateway_api, "client", "both", parent=0)["ResolvedRefs"][0] == "True"
    assert _route_conditions(snapshot.config.gateway_api, "client", "both", parent=1)["ResolvedRefs"][1] == \
        "RefNotPermitted"
    assert _hosts(snapshot, "client") == [("echo-v2", 0)]


def test_a_tcp_route_on_a_service_is_refused_naming_the_kind() -> None:
    route = {"apiVersion": f"{GROUP}/v1alpha2", "kind": "TCPRoute", "metadata": {"name": "raw", "namespace": "shop"},
             "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "echo"}],
                      "rules": [{"backendRefs": [{"name": "echo", "port": 8080}]}]}}
    conditions = _route_conditions(_snapshot(route).config.gateway_api, "shop", "raw", kind="TCPRoute")
    assert conditions["Accepted"][:2] == ("False", "UnsupportedValue")


def test_resolved_waypoints_says_whether_the_parent_names_a_waypoint_as_istiod() -> None:
    """istiod's ResolvedWaypoints (written with ambient on): always True, its message what is missing."""
    labelled_namespace = {"apiVersion": "v1", "kind": "Namespace",
                          "metadata": {"name": "shop", "labels": {"istio.io/use-waypoint": "waypoint"}}}
    snapshot = _snapshot(_mesh_route("split", "shop"), labelled_namespace,
                         _mesh_route("gone", "shop", {"group": "", "kind": "Service", "name": "nope"}))
    assert _route_conditions(snapshot.config.gateway_api, "shop", "split")["ResolvedWaypoints"] == (
        "True", "ResolvedWaypoints", "All waypoints resolved")
    assert _route_conditions(snapshot.config.gateway_api, "shop", "gone")["ResolvedWaypoints"] == (
        "True", "ResolvedWaypoints", "parent not found")
    opted_out = {**labelled_namespace, "metadata": {"name": "shop", "labels": {"istio.io/use-waypoint": "None"}}}
    assert _route_conditions(_snapshot(_mesh_route("split", "shop"), opted_out).config.gateway_api, "shop", "split")[
        "ResolvedWaypoints"][2].startswith("istio.io/use-waypoint label missing")

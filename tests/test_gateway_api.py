"""The Gateway API without a cluster: objects validated on the way in (errors naming the field),
converted to Istio's Gateways and VirtualServices, the status of each object (Istio's conditions
and reasons), and credentials sent only where a listener references them. Real traffic:
tests/test_gateway_api_traffic.py; a real API server: e2e/test_gateway_api.py."""

from __future__ import annotations

import base64
import copy
import dataclasses
import re
from typing import Any

import pytest
import yaml
from envoy.config.route.v3 import route_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2

from istiod.model.builder import build_snapshot
from istiod.model.config.gateway_api import GatewayApiConfig
from istiod.model.proxy import Proxy, proxy_from_node
from istiod.model.snapshot import Snapshot
from istiod.sources.convert import ConversionError, convert
from istiod.sources.fields import ObjectKey
from istiod.sources.store import Store
from istiod.status.gateway_api import merged_status
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import ROUTER
from tests.conftest import render
from tests.test_gateway_gen import server_credential, tls_secret

GROUP = "gateway.networking.k8s.io"
NODE = "router~10.0.0.9~web-1.istio-ingress~istio-ingress.svc.cluster.local"
CERT = server_credential("secure.example.com")


def _documents() -> list[dict[str, Any]]:
    text = render("gateway-api-mesh.yaml", http_port=8080, https_port=8443, other_port=9443, app_port=9000,
                  v1_ip="127.0.0.41", v2_ip="127.0.0.42",
                  grpc_ip="127.0.0.43", grpc_port=9001)
    return [*yaml.safe_load_all(text), tls_secret("web-cert", "istio-ingress", *CERT[1:])]


def _snapshot(*extra: dict[str, Any], without: tuple[str, ...] = ()) -> Snapshot:
    store = Store()
    for document in [*_documents(), *extra]:
        if document["metadata"]["name"] not in without:
            store.apply(document)
    return build_snapshot(store, "v1")


def _converted(*extra: dict[str, Any], without: tuple[str, ...] = ()) -> GatewayApiConfig:
    return _snapshot(*extra, without=without).config.gateway_api


def _conditions(conditions: list[dict[str, Any]]) -> dict[str, tuple[str, str, str]]:
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in conditions}


def _route_conditions(converted: GatewayApiConfig, namespace: str, name: str, kind: str = "HTTPRoute",
                      parent: int = 0) -> dict[str, tuple[str, str, str]]:
    return _conditions(converted.statuses[(kind, namespace, name)]["parents"][parent]["conditions"])


def _listener(converted: GatewayApiConfig, name: str) -> dict[str, Any]:
    status = converted.statuses[("KubernetesGateway", "istio-ingress", "web")]
    return next(x for x in status["listeners"] if x["name"] == name)


def _proxy(verified: bool = True) -> Proxy:
    labels = {"gateway.networking.k8s.io/gateway-name": "web"}
    return dataclasses.replace(proxy_from_node(NODE, {"LABELS": labels}), verified=verified)


def _route(name: str, namespace: str = "shop", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/v1", "kind": "HTTPRoute", "metadata": {"name": name, "namespace": namespace},
            "spec": {"parentRefs": [{"name": "web", "namespace": "istio-ingress"}], **spec}}


# --- sources ---------------------------------------------------------------------------------------

def test_gateway_api_gateway_and_istio_gateway_are_different_kinds() -> None:
    store = Store()
    for document in _documents():
        store.apply(document)
    store.apply({"apiVersion": "networking.istio.io/v1", "kind": "Gateway", "metadata": {"name": "web",
                 "namespace": "istio-ingress"}, "spec": {"selector": {"istio": "ingressgateway"}, "servers": [
                     {"port": {"number": 80, "name": "http", "protocol": "HTTP"}, "hosts": ["*"]}]}})
    assert store.get(ObjectKey("KubernetesGateway", "istio-ingress", "web")) is not None
    assert store.get(ObjectKey("Gateway", "istio-ingress", "web")) is not None
    snapshot = build_snapshot(store, "v1")
    assert [g.meta.name for g in snapshot.config.gateways] == ["web"]
    assert len(snapshot.config.gateway_api.gateways) == 2  # the Gateway API listeners' (http, https)


@pytest.mark.parametrize(("path", "value", "error"), [
    ("spec.listeners.0.protocol", "", "listeners[0]: protocol is required"),
    ("spec.listeners.0.port", 0, "listeners[0]: port 0 is not in 1-65535"),
    ("spec.listeners.1.tls.mode", "Resign", "listeners[1].tls: mode 'Resign' is not Terminate or Passthrough"),
    ("spec.gatewayClassName", "", "spec: gatewayClassName is required"),
    ("spec.listeners.0.allowedRoutes.namespaces.from", "Some", "namespaces.from 'Some' is not Same, All or Selector"),
])
def test_a_gateway_the_api_would_refuse_names_the_field(path: str, value: Any, error: str) -> None:
    gateway = copy.deepcopy(next(d for d in _documents() if d["kind"] == "Gateway"))
    target: Any = gateway
    *parents, last = path.split(".")
    for part in parents:
        target = target[int(part)] if part.isdigit() else target.setdefault(part, {})
    target[last] = value
    with pytest.raises(ConversionError, match=error.replace("[", r"\[").replace("]", r"\]")):
        convert(gateway)


@pytest.mark.parametrize(("rule", "error"), [
    ({"matches": [{"path": {"type": "Glob", "value": "/x"}}]}, "path: type 'Glob' is not one of"),
    ({"matches": [{"path": {"type": "Exact", "value": "x"}}]}, "must be an absolute path"),
    ({"filters": [{"type": "RequestRedirect", "requestRedirect": {"statusCode": 305}}]}, "statusCode 305"),
    ({"timeouts": {"request": "1d"}}, "timeouts: request: '1d' is not a Gateway API duration"),
    ({"backendRefs": [{"port": 80}]}, r"backendRefs\[0\]: name is required"),
])
def test_a_route_the_api_would_refuse_names_the_field(rule: dict[str, Any], error: str) -> None:
    with pytest.raises(ConversionError, match=error):
        convert(_route("bad", rules=[rule]))


def test_a_wrong_api_version_is_refused() -> None:
    body = _route("old")
    body["apiVersion"] = f"{GROUP}/v9"
    with pytest.raises(ConversionError, match="serves v1, v1beta1, v1alpha2"):
        convert(body)


# --- conversion and status -------------------------------------------------------------------------

def test_listeners_become_istio_gateways_selecting_the_gateway_pods() -> None:
    converted = _converted()
    assert [(g.meta.name, g.selector, g.servers[0].port.number) for g in converted.gateways] == [
        ("web-istio-autogenerated-k8s-gateway-http", (("gateway.networking.k8s.io/gateway-name", "web"),), 8080),
        ("web-istio-autogenerated-k8s-gateway-https", (("gateway.networking.k8s.io/gateway-name", "web"),), 8443)]
    assert converted.gateways[1].servers[0].tls is not None
    assert converted.gateways[1].servers[0].tls.credential_name == "kubernetes-gateway://istio-ingress/web-cert"
    assert converted.missing_classes == ("istio", "istio-waypoint")  # istiod creates its builtin classes


def test_routes_are_ordered_by_the_specs_precedence() -> None:
    vs = next(v for v in _converted().virtual_services if v.hosts == ("web.example.com",))
    paths = [(h.match[0].uri.kind.value, h.match[0].uri.value) for h in vs.http if h.match[0].uri is not None]
    assert paths[0] == ("exact", "/headers")  # exact first, then the longest prefix
    assert paths[-1] == ("prefix", "/")
    assert vs.gateway_semantics


def test_gateway_status_reports_conflicts_and_missing_secrets() -> None:
    converted = _converted()
    gateway = converted.statuses[("KubernetesGateway", "istio-ingress", "web")]
    assert _conditions(gateway["conditions"])["Accepted"] == (
        "True", "ListenersNotValid", "One or more of the Gateway's listeners are invalid")
    assert _conditions(gateway["conditions"])["Programmed"] == (
        "True", "Programmed", "Resource programmed, assigned to service(s) "
        "web-istio.istio-ingress.svc.cluster.local:8080, web-istio.istio-ingress.svc.cluster.local:8443")
    assert gateway["addresses"] == [{"type": "IPAddress", "value": "10.96.0.80"}]
    # shop, broken and the GRPCRoute health (allowed by their namespace's label)
    assert _listener(converted, "http")["attachedRoutes"] == 3
    assert _listener(converted, "https")["attachedRoutes"] == 1
    clash = _conditions(_listener(converted, "clash")["conditions"])
    assert {k: v[:2] for k, v in clash.items()} == {  # as istiod: no ResolvedRefs on a conflicted listener
        "Accepted": ("False", "ProtocolConflict"), "Programmed": ("False", "ProtocolConflict"),
        "Conflicted": ("True", "ProtocolConflict")}
    bad = _conditions(_listener(converted, "bad-cert")["conditions"])
    assert bad["ResolvedRefs"] == ("False", "InvalidCertificateRef",
                                   "invalid certificate reference Secret istio-ingress/missing-cert: not found")
    assert bad["Programmed"] == ("False", "Invalid", "Bad TLS configuration")


def test_a_gateway_without_its_deployment_is_not_programmed() -> None:
    gateway = _converted(without=("web-1",)).statuses[("KubernetesGateway", "istio-ingress", "web")]
    assert _conditions(gateway["conditions"])["Programmed"] == (
        "False", "AddressNotAssigned", "Failed to assign to any requested addresses: "
        'no instances found for hostname "web-istio.istio-ingress.svc.cluster.local"')
    assert "addresses" not in gateway
    # No Service at all: istiod's reason is that the address is unusable, not unassigned.
    gateway = _converted(without=("web-1", "web-istio")).statuses[("KubernetesGateway", "istio-ingress", "web")]
    assert _conditions(gateway["conditions"])["Programmed"] == (
        "False", "AddressNotUsable", "Failed to assign to any requested addresses: "
        'hostname "web-istio.istio-ingress.svc.cluster.local" not found')


def test_route_status_names_what_did_not_resolve() -> None:
    converted = _converted()
    ok = _route_conditions(converted, "shop", "shop")
    assert ok == {"Accepted": ("True", "Accepted", "Route was valid"),
                  "ResolvedRefs": ("True", "ResolvedRefs", "All references resolved"),
                  "ResolvedWaypoints": ("True", "ResolvedWaypoints", "All waypoints resolved")}
    broken = _route_conditions(converted, "shop", "broken")
    assert broken["Accepted"][:2] == ("True", "Accepted")
    assert broken["ResolvedRefs"][:2] == ("False", "BackendNotFound")
    assert "backend(nowhere.shop.svc.cluster.local) not found" in broken["ResolvedRefs"][2]
    assert "'/(?=lookahead)' is not a valid RE2 regex" in broken["ResolvedRefs"][2]
    # A TCPRoute on a Gateway without a TCP listener: no listener takes its kind.
    tcp = _route_conditions(converted, "istio-ingress", "raw", kind="TCPRoute")
    assert tcp["Accepted"][:2] == ("False", "NotAllowedByListeners")


def test_a_removed_reference_grant_is_refused_and_not_followed() -> None:
    converted = _converted(without=("from-ingress",))
    resolved = _route_conditions(converted, "istio-ingress", "secure")["ResolvedRefs"]
    assert resolved[:2] == ("False", "RefNotPermitted")
    vs = next(v for v in converted.virtual_services if v.hosts == ("secure.example.com",))
    assert vs.http[0].route == () and vs.http[0].direct_response is not None  # the spec's 500, never the backend


@pytest.mark.parametrize(("route", "reason"), [
    (_route("no-gateway", parentRefs=[{"name": "missing"}]), None),
    (_route("no-section", parentRefs=[{"name": "web", "namespace": "istio-ingress", "sectionName": "nope"}]),
     "NoMatchingParent"),
    (_route("not-allowed", namespace="default", parentRefs=[{"name": "web", "namespace": "istio-ingress",
                                                             "sectionName": "http"}]), "NotAllowedByListeners"),
    (_route("entry", parentRefs=[{"group": "networking.istio.io", "kind": "ServiceEntry", "name": "echo"}]),
     "UnsupportedValue"),
])
def test_a_route_a_listener_refuses_says_why(route: dict[str, Any], reason: str | None) -> None:
    converted = _converted({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}, route)
    key = ("HTTPRoute", route["metadata"]["namespace"], route["metadata"]["name"])
    if reason is None:  # a Gateway that is not there: no class, so not ours to report
        assert key not in converted.statuses
        return
    assert _conditions(converted.statuses[key]["parents"][0]["conditions"])["Accepted"][:2] == ("False", reason)


def test_a_hostname_no_listener_serves() -> None:
    route = _route("elsewhere", hostnames=["secure.example.org"],
                   parentRefs=[{"name": "web", "namespace": "istio-ingress", "sectionName": "https"}])
    accepted = _route_conditions(_converted(route), "shop", "elsewhere")["Accepted"]
    assert accepted[:2] == ("False", "NoMatchingListenerHostname")


def test_a_gateway_of_another_class_is_left_to_its_controller() -> None:
    other = {"apiVersion": f"{GROUP}/v1", "kind": "Gateway", "metadata": {"name": "theirs", "namespace": "shop"},
             "spec": {"gatewayClassName": "example", "listeners": [
                 {"name": "http", "port": 80, "protocol": "HTTP"}]}}
    converted = _converted(other)
    assert ("KubernetesGateway", "shop", "theirs") not in converted.statuses
    assert all(not g.meta.name.startswith("theirs") for g in converted.gateways)


# --- xDS -------------------------------------------------------------------------------------------

def test_the_gateway_proxy_gets_routes_and_only_referenced_credentials() -> None:
    snapshot = _snapshot()
    routes = {r.name: route_pb2.RouteConfiguration.FromString(r.value)
              for r in ROUTER[types.ROUTE](snapshot, _proxy(), None, ResourceCache())}
    assert set(routes) == {"http.8080", "https.8443.default.web-istio-autogenerated-k8s-gateway-https.istio-ingress"}
    hosts = {h.name for h in routes["http.8080"].virtual_hosts}
    assert hosts == {"web.example.com:8080", "broken.example.com:8080", "rpc.example.com:8080"}
    secrets = ROUTER[types.SECRET](snapshot, _proxy(), ["kubernetes-gateway://istio-ingress/web-cert",
                                                        "kubernetes-gateway://shop/anything"], ResourceCache())
    assert [s.name for s in secrets] == ["kubernetes-gateway://istio-ingress/web-cert"]
    assert secret_pb2.Secret.FromString(secrets[0].value).tls_certificate.certificate_chain.inline_bytes == CERT[1]
    # Another proxy (no Gateway of its own) is sent nothing; nor is one with the label in another namespace.
    other = dataclasses.replace(proxy_from_node(NODE, {"LABELS": {"app": "x"}}), verified=True)
    assert ROUTER[types.SECRET](snapshot, other, ["kubernetes-gateway://istio-ingress/web-cert"], ResourceCache()) == []
    elsewhere = dataclasses.replace(proxy_from_node(NODE.replace("istio-ingress", "shop"), {
        "LABELS": {"gateway.networking.k8s.io/gateway-name": "web"}}), verified=True)
    assert elsewhere.namespace == "shop"
    assert ROUTER[types.ROUTE](snapshot, elsewhere, None, ResourceCache()) == []


# --- status writing --------------------------------------------------------------------------------

def test_status_keeps_other_controllers_parents_and_unchanged_transition_times() -> None:
    wanted = _converted().statuses[("HTTPRoute", "shop", "shop")]
    theirs = {"parentRef": {"name": "other"}, "controllerName": "example.com/other", "conditions": []}
    first = merged_status("HTTPRoute", wanted, {"parents": [theirs]}, "2026-01-01T00:00:00Z")
    assert first["parents"][0] == theirs and len(first["parents"]) == 2
    again = merged_status("HTTPRoute", wanted, first, "2026-02-02T00:00:00Z")
    assert again == first  # nothing changed: the times stay


def test_a_grpc_route_routes_methods_as_paths() -> None:
    route = {"apiVersion": f"{GROUP}/v1", "kind": "GRPCRoute", "metadata": {"name": "rpc", "namespace": "shop"},
             "spec": {"parentRefs": [{"name": "web", "namespace": "istio-ingress", "sectionName": "http"}],
                      "hostnames": ["rpc2.example.com"], "rules": [
                          {"matches": [{"method": {"service": "echo.Echo", "method": "Say"}}],
                           "backendRefs": [{"name": "echo", "port": 8080}]},
                          {"matches": [{"method": {"service": "echo.Echo"}, "headers": [{"name": "x-v", "value": "2"}]}],
                           "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {
                               "set": [{"name": "x-via", "value": "grpcroute"}]}}],
                           "backendRefs": [{"name": "echo-v2", "port": 8080}]},
                          {"matches": [{"method": {"type": "RegularExpression", "method": "(?=x)"}}],
                           "backendRefs": [{"name": "echo", "port": 8080}]}]}}
    converted = _converted(route)
    vs = next(v for v in converted.virtual_services if v.hosts == ("rpc2.example.com",))
    assert [(h.match[0].uri.kind.value, h.match[0].uri.value) for h in vs.http if h.match[0].uri] == [
        ("exact", "/echo.Echo/Say"), ("prefix", "/echo.Echo/")]
    assert vs.http[1].headers.request.set == (("x-via", "grpcroute"),)
    resolved = _route_conditions(converted, "shop", "rpc", kind="GRPCRoute")["ResolvedRefs"]
    assert resolved[:2] == ("False", "UnsupportedValue") and "is not a valid RE2 regex" in resolved[2]
    assert _listener(converted, "http")["attachedRoutes"] == 4


def test_a_listener_protocol_not_served_is_refused_in_status() -> None:
    gateway = copy.deepcopy(next(d for d in _documents() if d["kind"] == "Gateway"))
    gateway["spec"]["listeners"].append({"name": "raw", "port": 9000, "protocol": "UDP"})
    converted = _converted(gateway)
    raw = _conditions(_listener(converted, "raw")["conditions"])
    assert raw["Accepted"] == ("False", "UnsupportedProtocol",
                               "protocol UDP is not implemented by this istiod (HTTP, HTTPS, TLS and TCP are)")
    assert _listener(converted, "raw")["supportedKinds"] == []


def test_a_rule_with_a_filter_not_implemented_answers_500_and_says_why() -> None:
    route = _route("prefix-redirect", hostnames=["moved.example.com"], rules=[
        {"filters": [{"type": "ExtensionRef", "extensionRef": {"group": "example.com", "kind": "Thing", "name": "x"}}]},
        {"matches": [{"path": {"value": "/ok"}}], "backendRefs": [{"name": "echo", "port": 8080}]}])
    converted = _converted(route)
    resolved = _route_conditions(converted, "shop", "prefix-redirect")["ResolvedRefs"]
    assert resolved[:2] == ("False", "InvalidFilter") and "filter type 'ExtensionRef' is not implemented" in resolved[2]
    vs = next(v for v in converted.virtual_services if v.hosts == ("moved.example.com",))
    assert [(h.direct_response is not None, h.route != ()) for h in vs.http] == [(False, True), (True, False)]


def test_allowed_routes_by_a_namespace_selector_with_match_expressions() -> None:
    gateway = copy.deepcopy(next(d for d in _documents() if d["kind"] == "Gateway"))
    selector = {"matchExpressions": [{"key": "shared-gateway-access", "operator": "In", "values": ["true", "yes"]},
                                     {"key": "quarantined", "operator": "DoesNotExist"}]}
    gateway["spec"]["listeners"][0]["allowedRoutes"] = {"namespaces": {"from": "Selector", "selector": selector}}
    converted = _converted(gateway)
    http = _listener(converted, "http")
    assert _conditions(http["conditions"])["Accepted"][0] == "True" and http["attachedRoutes"] > 0
    # A namespace the expressions leave out: the routes there no longer attach to that listener.
    shop = next(d for d in _documents() if d["kind"] == "Namespace" and d["metadata"]["name"] == "shop")
    shop["metadata"]["labels"]["quarantined"] = "1"
    assert _listener(_converted(gateway, shop), "http")["attachedRoutes"] == 0
    gateway["spec"]["listeners"][0]["allowedRoutes"]["namespaces"]["selector"] = {
        "matchExpressions": [{"key": "a", "operator": "Near"}]}
    with pytest.raises(ConversionError, match="operator: 'Near' is not one of In, NotIn, Exists, DoesNotExist"):
        Store().apply(gateway)


def test_cors_filter_and_retry_as_istio_converts_them() -> None:
    route = _route("cors", hostnames=["c.example.com"], rules=[
        {"filters": [{"type": "CORS", "cors": {"allowOrigins": ["*", "https://a.example", "https://*.b.example",
                                                                 "https://c.example*"],
                                                "allowCredentials": True, "maxAge": 5}}],
         "retry": {"codes": [502, 503]},
         "backendRefs": [{"name": "echo", "port": 8080}]}])
    converted = _converted(route)
    [http] = next(v for v in converted.virtual_services if v.hosts == ("c.example.com",)).http
    cors = http.cors_policy
    assert cors is not None and [(o.kind.value, o.value) for o in cors.allow_origins] == [
        ("regex", r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s?#]+$"), ("exact", "https://a.example"),
        ("regex", r"^https://.*\.b\.example$"), ("prefix", "https://c.example")]
    assert (cors.allow_credentials, cors.max_age.total_seconds() if cors.max_age else 0, cors.unmatched_preflights) == (
        True, 5, "IGNORE")
    assert http.retries is not None and http.retries.attempts == 2
    assert http.retries.retry_on == ("connect-failure", "refused-stream", "unavailable", "cancelled", "502", "503")
    assert _route_conditions(converted, "shop", "cors")["ResolvedRefs"][0] == "True"


def test_a_backends_filters_are_its_destinations_headers_and_others_refused() -> None:
    route = _route("per-backend", hostnames=["pb.example.com"], rules=[
        {"backendRefs": [{"name": "echo", "port": 8080, "filters": [
            {"type": "RequestHeaderModifier", "requestHeaderModifier": {"add": [{"name": "x-a", "value": "1"}]}},
            {"type": "ResponseHeaderModifier", "responseHeaderModifier": {"remove": ["server"]}}]}]},
        {"matches": [{"path": {"value": "/mirror"}}], "backendRefs": [{"name": "echo", "port": 8080, "filters": [
            {"type": "RequestMirror", "requestMirror": {"backendRef": {"name": "echo", "port": 8080}}}]}]}])
    converted = _converted(route)
    vs = next(v for v in converted.virtual_services if v.hosts == ("pb.example.com",))
    plain = next(h for h in vs.http if h.route)
    headers = plain.route[0].headers
    assert (headers.request.add, headers.response.remove) == ((("x-a", "1"),), ("server",))
    resolved = _route_conditions(converted, "shop", "per-backend")["ResolvedRefs"]
    assert resolved[:2] == ("False", "InvalidFilter") and "unsupported filter type 'RequestMirror'" in resolved[2]


def _l4_gateway() -> dict[str, Any]:
    gateway = copy.deepcopy(next(d for d in _documents() if d["kind"] == "Gateway"))
    gateway["spec"]["listeners"] += [
        {"name": "passthrough", "port": 9543, "protocol": "TLS", "tls": {"mode": "Passthrough"},
         "allowedRoutes": {"namespaces": {"from": "All"}}},
        {"name": "raw", "port": 9000, "protocol": "TCP", "allowedRoutes": {"namespaces": {"from": "All"}}},
        {"name": "terminated", "port": 9544, "protocol": "TLS", "hostname": "*.example.com",
         "tls": {"mode": "Terminate", "certificateRefs": [{"name": "web-cert"}]}, "allowedRoutes": {"namespaces": {"from": "All"}}},
        {"name": "https-passthrough", "port": 9545, "protocol": "HTTPS", "tls": {"mode": "Passthrough"}}]
    return gateway


def _l4_route(kind: str, name: str, namespace: str = "shop", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/v1", "kind": kind, "metadata": {"name": name, "namespace": namespace},
            "spec": {"parentRefs": [{"name": "web", "namespace": "istio-ingress", **spec.pop("ref", {})}],
                     "rules": [{"backendRefs": [{"name": "echo", "namespace": "shop", "port": 8080}]}], **spec}}


def test_tls_and_tcp_listeners_and_their_routes_in_status() -> None:
    tls_route = _l4_route("TLSRoute", "sni", hostnames=["tls.example.com"], ref={"sectionName": "passthrough"})
    wrong_kind = _l4_route("TLSRoute", "wrong", ref={"sectionName": "raw"})
    missing = _l4_route("TLSRoute", "missing", hostnames=["gone.example.com"], ref={"sectionName": "passthrough"},
                        rules=[{"backendRefs": [{"name": "nowhere", "port": 1}]}])
    converted = _converted(_l4_gateway(), tls_route, wrong_kind, missing)
    for name, kinds in (("passthrough", ["TLSRoute"]), ("raw", ["TCPRoute"]), ("terminated", ["TLSRoute", "TCPRoute"])):
        listener = _listener(converted, name)
        assert [k["kind"] for k in listener["supportedKinds"]] == kinds, name
        assert _conditions(listener["conditions"])["Accepted"][:2] == ("True", "Accepted"), name
    # The TCPRoute `raw` of the fixture (parentRef without sectionName) attaches to the TCP listener;
    # its backend in another namespace has no ReferenceGrant for TCPRoutes.
    assert _listener(converted, "raw")["attachedRoutes"] == 1
    raw = _route_conditions(converted, "istio-ingress", "raw", kind="TCPRoute")
    assert raw["Accepted"][:2] == ("True", "Accepted") and raw["ResolvedRefs"][:2] == ("False", "RefNotPermitted")
    assert _listener(converted, "passthrough")["attachedRoutes"] == 2
    assert _route_conditions(converted, "shop", "sni", kind="TLSRoute") == {
        "Accepted": ("True", "Accepted", "Route was valid"), "ResolvedRefs": ("True", "ResolvedRefs", "All references resolved"),
        "ResolvedWaypoints": ("True", "ResolvedWaypoints", "All waypoints resolved")}
    assert _route_conditions(converted, "shop", "wrong", kind="TLSRoute")["Accepted"][:2] == ("False", "NotAllowedByListeners")
    resolved = _route_conditions(converted, "shop", "missing", kind="TLSRoute")["ResolvedRefs"]
    assert resolved[:2] == ("False", "BackendNotFound")
    https = _conditions(_listener(converted, "https-passthrough")["conditions"])
    assert https["Accepted"] == ("False", "UnsupportedProtocol", "tls.mode Passthrough requires protocol TLS")
    servers = {g.meta.name.rsplit("-", 1)[-1]: g.servers[0] for g in converted.gateways}
    assert (servers["passthrough"].port.protocol, servers["passthrough"].tls and servers["passthrough"].tls.mode.value) == (
        "TLS", "PASSTHROUGH")
    assert servers["raw"].port.protocol == "TCP" and servers["raw"].tls is None
    (sni,) = [v for v in converted.virtual_services if v.meta.name.startswith("sni-shop-tlsroute")]
    assert sni.hosts == ("tls.example.com",) and sni.tls[0].match[0].sni_hosts == ("tls.example.com",)
    assert sni.tls[0].route[0].destination.host == "echo.shop.svc.cluster.local"


def test_tls_passthrough_and_tcp_listeners_reach_envoy_config() -> None:
    from envoy.config.listener.v3 import listener_pb2
    from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2

    routes = [_l4_route("TLSRoute", "sni", hostnames=["tls.example.com"], ref={"sectionName": "passthrough"}),
              _l4_route("TLSRoute", "any", ref={"sectionName": "terminated"}),
              _l4_route("TCPRoute", "tcp", ref={"sectionName": "raw"})]
    snapshot = _snapshot(_l4_gateway(), *routes)
    listeners = {r.name: listener_pb2.Listener.FromString(r.value)
                 for r in ROUTER[types.LISTENER](snapshot, _proxy(), None, ResourceCache())}
    cluster = "outbound|8080||echo.shop.svc.cluster.local"
    (passthrough,) = listeners["0.0.0.0_9543"].filter_chains
    assert list(passthrough.filter_chain_match.server_names) == ["tls.example.com"]
    assert not passthrough.HasField("transport_socket")
    (raw,) = listeners["0.0.0.0_9000"].filter_chains
    assert tcp_proxy_pb2.TcpProxy.FromString(raw.filters[0].typed_config.value).cluster == cluster
    # TLS terminated by the listener's certificate, then the TLSRoute's backend (istiod's fallback).
    (terminated,) = listeners["0.0.0.0_9544"].filter_chains
    assert terminated.HasField("transport_socket") and list(terminated.filter_chain_match.server_names) == ["*.example.com"]
    assert tcp_proxy_pb2.TcpProxy.FromString(terminated.filters[0].typed_config.value).cluster == cluster


def test_tls_terminate_mode_options_and_two_certificates_in_status() -> None:
    """istiod's `gateway.istio.io/tls-terminate-mode` (MUTUAL, OPTIONAL_MUTUAL, ISTIO_MUTUAL) and up to
    two certificateRefs (its credentialNames); a value istiod would silently take as SIMPLE, another
    option and a third certificate are refused in the listener's status."""
    gateway = copy.deepcopy(next(d for d in _documents() if d["kind"] == "Gateway"))
    mode = "gateway.istio.io/tls-terminate-mode"

    def https(name: str, port: int, options: dict[str, str], refs: int = 1) -> dict[str, Any]:
        return {"name": name, "port": port, "protocol": "HTTPS", "hostname": f"{name}.example.com",
                "tls": {"mode": "Terminate", "certificateRefs": [{"name": "web-cert"}] * refs, "options": options}}

    gateway["spec"]["listeners"] += [
        https("mutual", 9601, {mode: "MUTUAL"}), https("optional", 9602, {mode: "OPTIONAL_MUTUAL"}),
        https("mesh", 9603, {mode: "ISTIO_MUTUAL"}), https("two", 9604, {}, refs=2),
        https("simple-builtin", 9605, {mode: "ISTIO_SIMPLE"}), https("ciphers", 9606, {"gateway.istio.io/tls-cipher-suites": "x"}),
        https("three", 9607, {}, refs=3)]
    converted = _converted(gateway)
    servers = {g.meta.name.rsplit("-", 1)[-1]: g.servers[0] for g in converted.gateways}
    expected = {"mutual": ("MUTUAL", "kubernetes-gateway://istio-ingress/web-cert", ()),
                "optional": ("OPTIONAL_MUTUAL", "kubernetes-gateway://istio-ingress/web-cert", ()),
                "mesh": ("ISTIO_MUTUAL", "", ()),
                "two": ("SIMPLE", "", ("kubernetes-gateway://istio-ingress/web-cert",) * 2)}
    for name, (tls_mode, credential, credentials) in expected.items():
        tls = servers[name].tls
        assert tls is not None and (tls.mode.value, tls.credential_name, tls.credential_names) == (tls_mode, credential, credentials)
        conditions = _conditions(_listener(converted, name)["conditions"])
        assert conditions["Accepted"][:2] == ("True", "Accepted") and conditions["Programmed"][0] == "True", name
    for name, condition, reason, message in (
            ("simple-builtin", "Accepted", "UnsupportedValue", "'ISTIO_SIMPLE' is not implemented by this istiod"),
            ("ciphers", "Accepted", "UnsupportedValue", "tls.options (gateway.istio.io/tls-cipher-suites) is not implemented"),
            ("three", "ResolvedRefs", "InvalidCertificateRef", "TLS mode can only support up to 2 server certificates")):
        conditions = _conditions(_listener(converted, name)["conditions"])
        assert conditions[condition][:2] == ("False", reason) and message in conditions[condition][2], name
        assert name not in servers


def test_frontend_validation_makes_listeners_mutual_and_bad_ca_references_are_reported() -> None:
    """spec.tls.frontend (istiod's resolveGatewayTLS, buildCaCertificateReference): the default's CA
    verifies the HTTPS listeners' clients (MUTUAL), a perPort entry overrides it (without validation:
    SIMPLE); a missing Secret, a Secret without ca.crt, a kind other than Secret are reported on the
    listener, which is left out."""
    ca = server_credential("client-ca")[0]
    client_ca = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "client-ca", "namespace": "istio-ingress"},
                 "data": {"ca.crt": base64.b64encode(ca).decode()}}
    gateway = copy.deepcopy(next(d for d in _documents() if d["kind"] == "Gateway"))

    def https(name: str, port: int) -> dict[str, Any]:
        return {"name": name, "port": port, "protocol": "HTTPS", "hostname": f"{name}.example.com",
                "tls": {"mode": "Terminate", "certificateRefs": [{"name": "web-cert"}]}}

    def validation(name: str, kind: str = "Secret") -> dict[str, Any]:
        return {"validation": {"caCertificateRefs": [{"group": "", "kind": kind, "name": name}]}}

    gateway["spec"]["listeners"] = [https("mutual", 9701), https("plain", 9702), https("missing", 9703),
                                    https("no-ca", 9704), https("configmap", 9705), https("service", 9706)]
    gateway["spec"]["tls"] = {"frontend": {"default": validation("client-ca"), "perPort": [
        {"port": 9702, "tls": {}}, {"port": 9703, "tls": validation("nowhere")}, {"port": 9704, "tls": validation("web-cert")},
        {"port": 9705, "tls": validation("client-ca", "ConfigMap")}, {"port": 9706, "tls": validation("client-ca", "Service")}]}}
    converted = _converted(gateway, client_ca)
    servers = {g.meta.name.rsplit("-", 1)[-1]: g.servers[0] for g in converted.gateways}
    mutual, plain = servers["mutual"].tls, servers["plain"].tls
    assert mutual is not None and (mutual.mode.value, mutual.ca_cert_credential_name) == (
        "MUTUAL", "kubernetes-gateway://istio-ingress/client-ca-cacert")
    assert plain is not None and (plain.mode.value, plain.ca_cert_credential_name) == ("SIMPLE", "")
    for name, reason, message in (
            ("missing", "InvalidCACertificateRef", "secret istio-ingress/nowhere not found"),
            ("no-ca", "InvalidCACertificateRef", "didn't have expected keys cacert or ca.crt"),
            ("configmap", "InvalidCACertificateRef", "ConfigMaps are not implemented by this istiod"),
            ("service", "InvalidCACertificateKind", "only secret and configmap are allowed")):
        conditions = _conditions(_listener(converted, name)["conditions"])
        assert conditions["Accepted"][:2] == ("False", "NoValidCACertificate") and message in conditions["Accepted"][2], name
        assert conditions["ResolvedRefs"][:2] == ("False", reason), name
        assert conditions["Programmed"] == ("False", "Invalid", "Bad TLS configuration"), name
        assert name not in servers
    # The proxy is sent the CA of the Secret the validation names (its ca.crt).
    names = ["kubernetes-gateway://istio-ingress/client-ca-cacert"]
    (secret,) = ROUTER[types.SECRET](_snapshot(gateway, client_ca), _proxy(), names, ResourceCache())
    assert secret_pb2.Secret.FromString(secret.value).validation_context.trusted_ca.inline_bytes == ca


@pytest.mark.parametrize("tls, error", [
    ({"backend": {"clientCertificateRef": {"name": "c"}}}, "spec.tls: backend is not implemented by this istiod"),
    ({"frontend": {"default": {"validation": {"caCertificateRefs": [{"group": "", "kind": "Secret", "name": "c"}],
                                              "mode": "Sometimes"}}}}, "mode 'Sometimes' is not AllowValidOnly"),
    ({"frontend": {"default": {"validation": {"caCertificateRefs": []}}}}, "caCertificateRefs: at least one reference"),
    ({"frontend": {"default": {}, "perPort": [{"port": 70000, "tls": {}}]}}, "port 70000 is not in 1-65535"),
])
def test_bad_gateway_tls_names_the_field(tls: dict[str, Any], error: str) -> None:
    gateway = copy.deepcopy(next(d for d in _documents() if d["kind"] == "Gateway"))
    gateway["spec"]["tls"] = tls
    with pytest.raises(ConversionError, match=re.escape(error)):
        convert(gateway)


def test_allow_insecure_fallback_is_optional_mutual_without_chain_verification() -> None:
    """AllowInsecureFallback (istiod: OPTIONAL_MUTUAL, insecureSkipVerify): the client's certificate is
    asked for, not verified; the Gateway says so in InsecureFrontendValidationMode. The option's
    MUTUAL verifies again, as istiod."""
    ca = server_credential("client-ca")[0]
    client_ca = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "client-ca", "namespace": "istio-ingress"},
                 "data": {"ca.crt": base64.b64encode(ca).decode()}}
    gateway = copy.deepcopy(next(d for d in _documents() if d["kind"] == "Gateway"))
    tls = {"mode": "Terminate", "certificateRefs": [{"name": "web-cert"}]}
    gateway["spec"]["listeners"] = [
        {"name": "fallback", "port": 9801, "protocol": "HTTPS", "hostname": "a.example.com", "tls": tls},
        {"name": "forced", "port": 9802, "protocol": "HTTPS", "hostname": "b.example.com",
         "tls": {**tls, "options": {"gateway.istio.io/tls-terminate-mode": "MUTUAL"}}}]
    gateway["spec"]["tls"] = {"frontend": {"default": {"validation": {
        "caCertificateRefs": [{"group": "", "kind": "Secret", "name": "client-ca"}], "mode": "AllowInsecureFallback"}}}}
    converted = _converted(gateway, client_ca)
    servers = {g.meta.name.rsplit("-", 1)[-1]: g.servers[0].tls for g in converted.gateways}
    fallback, forced = servers["fallback"], servers["forced"]
    assert fallback is not None and (fallback.mode.value, fallback.insecure_skip_verify) == ("OPTIONAL_MUTUAL", True)
    assert forced is not None and (forced.mode.value, forced.insecure_skip_verify) == ("MUTUAL", False)
    status = converted.statuses[("KubernetesGateway", "istio-ingress", "web")]
    assert _conditions(status["conditions"])["InsecureFrontendValidationMode"] == (
        "True", "ConfigurationChanged", "Gateway is operating in AllowInsecureFallback mode for frontend validation")

"""VirtualService mirrors, CORS policies, retry backoff and match stat prefixes, translated as
istiod's route translation (model in, protos out), for Envoy and for proxyless gRPC;
tests/test_envoy_mirror_cors.py proves the same with a real Envoy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.cors.v3 import cors_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.type.v3 import percent_pb2

from istiod.model.builder import build_snapshot
from istiod.model.proxy import proxy_from_node
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import PROXYLESS_GRPC, SIDECAR
from istiod.xds.gen.filters import CORS_FILTER, FAULT_FILTER, ROUTER_FILTER
from istiod.xds.gen.routes import PREVIOUS_HOSTS
from tests.test_gateway_gen import _generate, _snapshot as gateway_snapshot

DATA = Path(__file__).parent / "data"
WEB = "web.shop.svc.cluster.local"
NODE = "sidecar~127.0.0.31~web-1.shop~shop.svc.cluster.local"
HUNDRED, MILLION = percent_pb2.FractionalPercent.HUNDRED, percent_pb2.FractionalPercent.MILLION

ROUTES = """
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: web, namespace: shop}
spec:
  hosts: [web]
  http:
  - name: one
    match: [{uri: {prefix: /one}, statPrefix: one-stats}]
    mirror: {host: rpc, port: {number: 7070}}
    mirrorPercentage: {value: 12.5}
    corsPolicy:
      allowOrigins: [{exact: "https://a.example"}, {regex: "https://.*\\\\.b\\\\.example"}]
      allowMethods: [GET, POST]
      allowHeaders: [x-a, x-b]
      exposeHeaders: [x-c]
      maxAge: 24h
      allowCredentials: true
      unmatchedPreflights: IGNORE
    retries: {attempts: 4, backoff: 50ms, retryIgnorePreviousHosts: false}
    route: [{destination: {host: web}}]
  - name: many
    mirrors:
    - destination: {host: web, subset: v2}
    - destination: {host: rpc}
      percentage: {value: 0}
    retries: {attempts: 2, retryIgnorePreviousHosts: true}
    route: [{destination: {host: web}}]
  - name: legacy
    mirror: {host: web}
    mirror_percent: 30
    corsPolicy: {allowOrigin: ["https://c.example"]}
    route: [{destination: {host: web}}]
"""


def _snapshot() -> Any:
    store = Store()
    for document in [*yaml.safe_load_all((DATA / "sidecar-mesh.yaml").read_text()), *yaml.safe_load_all(ROUTES)]:
        store.apply(document)
    return build_snapshot(store, "v1")


def _sidecar_routes() -> dict[str, route_components_pb2.Route]:
    resources = SIDECAR[types.ROUTE](_snapshot(), proxy_from_node(NODE, {}), ["80"], ResourceCache())
    config = route_pb2.RouteConfiguration.FromString(resources[0].value)
    host = next(h for h in config.virtual_hosts if h.name == f"{WEB}:80")
    return {r.name: r for r in host.routes}


def _mirrors(route: route_components_pb2.Route) -> list[tuple[str, int, int]]:
    return [(m.cluster, m.runtime_fraction.default_value.numerator, m.runtime_fraction.default_value.denominator)
            for m in route.route.request_mirror_policies]


def test_mirrors_as_istiod_builds_them() -> None:
    routes = _sidecar_routes()
    # mirrorPercentage per million; the shadow keeps its Host and is never trace-sampled.
    assert _mirrors(routes["one"]) == [("outbound|7070||rpc.shop.svc.cluster.local", 125000, MILLION)]
    (policy,) = routes["one"].route.request_mirror_policies
    assert policy.disable_shadow_host_suffix_append and policy.trace_sampled.value is False
    assert policy.HasField("trace_sampled")
    # No percentage: all (per hundred); 0%: no mirror at all.
    assert _mirrors(routes["many"]) == [(f"outbound|80|v2|{WEB}", 100, HUNDRED)]
    # The deprecated integer is per hundred.
    assert _mirrors(routes["legacy"]) == [(f"outbound|80||{WEB}", 30, HUNDRED)]


def test_cors_policy_rides_on_the_route() -> None:
    routes = _sidecar_routes()
    policy = cors_pb2.CorsPolicy()
    routes["one"].typed_per_filter_config[CORS_FILTER].Unpack(policy)
    assert [(m.exact, m.safe_regex.regex) for m in policy.allow_origin_string_match] == [
        ("https://a.example", ""), ("", "https://.*\\.b\\.example")]
    assert (policy.allow_methods, policy.allow_headers, policy.expose_headers, policy.max_age) == (
        "GET,POST", "x-a,x-b", "x-c", "86400")
    assert policy.allow_credentials.value is True
    assert policy.forward_not_matching_preflights.value is False  # IGNORE: Envoy answers them
    assert (policy.filter_enabled.default_value.numerator, policy.filter_enabled.default_value.denominator) == (
        100, HUNDRED)
    legacy = cors_pb2.CorsPolicy()
    routes["legacy"].typed_per_filter_config[CORS_FILTER].Unpack(legacy)
    assert [m.exact for m in legacy.allow_origin_string_match] == ["https://c.example"]
    assert legacy.forward_not_matching_preflights.value is True and not legacy.HasField("allow_credentials")
    assert CORS_FILTER not in routes["many"].typed_per_filter_config


def test_retry_backoff_previous_hosts_and_stat_prefix() -> None:
    routes = _sidecar_routes()
    one = routes["one"].route.retry_policy
    assert one.num_retries.value == 4 and one.retry_back_off.base_interval.ToMilliseconds() == 50
    assert not one.retry_host_predicate and one.host_selection_retry_max_attempts == 5
    many = routes["many"].route.retry_policy
    assert [p.name for p in many.retry_host_predicate] == [PREVIOUS_HOSTS] and not many.HasField("retry_back_off")
    assert routes["one"].stat_prefix == "one-stats" and routes["many"].stat_prefix == ""


def test_the_cors_filter_sits_after_fault_and_before_the_router() -> None:
    resources = SIDECAR[types.LISTENER](_snapshot(), proxy_from_node(NODE, {}), None, ResourceCache())
    listener = next(listener_pb2.Listener.FromString(r.value) for r in resources if r.name == "0.0.0.0_80")
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    assert [f.name for f in manager.http_filters][-3:] == [FAULT_FILTER, CORS_FILTER, ROUTER_FILTER]


def test_proxyless_routes_keep_backoff_and_leave_out_mirrors_and_cors() -> None:
    """gRPC retries with the backoff; it ignores mirrors and has no CORS filter (its config would be
    a NACK), so neither is sent."""
    name = f"outbound|80||{WEB}"
    proxy = proxy_from_node(NODE, {"GENERATOR": "grpc"})
    resources = PROXYLESS_GRPC[types.ROUTE](_snapshot(), proxy, [name], ResourceCache())
    routes = {r.name: r for r in route_pb2.RouteConfiguration.FromString(resources[0].value).virtual_hosts[0].routes}
    assert routes["one"].route.retry_policy.retry_back_off.base_interval.ToMilliseconds() == 50
    for route in routes.values():
        assert not route.route.request_mirror_policies and CORS_FILTER not in route.typed_per_filter_config
    listener = PROXYLESS_GRPC[types.LISTENER](_snapshot(), proxy, [f"{WEB}:80"], ResourceCache())[0]
    manager = hcm_pb2.HttpConnectionManager()
    listener_pb2.Listener.FromString(listener.value).api_listener.api_listener.Unpack(manager)
    assert [f.name for f in manager.http_filters] == [FAULT_FILTER, ROUTER_FILTER]


GATEWAY_ROUTES = """
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: web, namespace: shop}
spec:
  hosts: [web.example.com]
  gateways: [istio-ingress/public]
  http:
  - name: edge
    match: [{uri: {prefix: /app}}]
    corsPolicy: {allowOrigins: [{exact: "https://a.example"}], allowMethods: [GET]}
    delegate: {name: app}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: app, namespace: shop}
spec:
  http:
  - name: mirrored
    match: [{uri: {prefix: /app/v1}}]
    mirrors: [{destination: {host: web}, percentage: {value: 50}}]
    route: [{destination: {host: web}}]
"""


def test_a_gateway_gets_mirrors_cors_and_delegated_routes() -> None:
    routes = _generate(types.ROUTE, gateway_snapshot(*yaml.safe_load_all(GATEWAY_ROUTES)), route_pb2.RouteConfiguration)
    (host,) = routes["http.8080"].virtual_hosts
    (route,) = host.routes
    assert route.name == "edge-mirrored" and route.match.prefix == "/app/v1"
    assert _mirrors(route) == [(f"outbound|80||{WEB}", 500000, MILLION)]
    policy = cors_pb2.CorsPolicy()
    route.typed_per_filter_config[CORS_FILTER].Unpack(policy)  # the root route's, as the delegate has none
    assert [m.exact for m in policy.allow_origin_string_match] == ["https://a.example"]

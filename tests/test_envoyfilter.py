"""EnvoyFilter: validation with Istio's messages, and its patches on the sidecar and gateway
generators' output, as istiod applies them (pure translation; tests/test_envoy_envoyfilter.py
shows a real Envoy taking the patched config)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.protobuf import duration_pb2

from istiod.model.builder import build_snapshot
from istiod.model.proxy import proxy_from_node
from istiod.model.snapshot import Snapshot
from istiod.sources.fields import ConversionError
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import SIDECAR
from istiod.xds.gen.envoyfilter import merge
from tests.test_sidecar_gen import DATA, SIDECAR_NODE

WEB = "outbound|80||web.shop.svc.cluster.local"
LUA = """
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {name: lua, namespace: shop}
spec:
  workloadSelector: {labels: {app: web}}
  configPatches:
  - applyTo: HTTP_FILTER
    match:
      context: SIDECAR_OUTBOUND
      listener:
        filterChain:
          filter:
            name: envoy.filters.network.http_connection_manager
            subFilter: {name: envoy.filters.http.router}
    patch:
      operation: INSERT_BEFORE
      value:
        name: envoy.filters.http.lua
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
          default_source_code: {inline_string: "function envoy_on_response(h) h:headers():add('x-lua', 'hi') end"}
  - applyTo: CLUSTER
    match: {context: SIDECAR_OUTBOUND, cluster: {service: web.shop.svc.cluster.local, portNumber: 80}}
    patch: {operation: MERGE, value: {connect_timeout: 7s, per_connection_buffer_limit_bytes: 1024}}
  - applyTo: CLUSTER
    match: {cluster: {name: BlackHoleCluster}}
    patch: {operation: REMOVE}
  - applyTo: CLUSTER
    patch:
      operation: ADD
      value: {name: extra, type: STATIC, connect_timeout: 1s, load_assignment: {cluster_name: extra}}
  - applyTo: VIRTUAL_HOST
    match: {context: SIDECAR_OUTBOUND, routeConfiguration: {portNumber: 80, vhost: {name: "web.shop.svc.cluster.local:80"}}}
    patch: {operation: MERGE, value: {response_headers_to_add: [{header: {key: x-vhost, value: patched}}]}}
  - applyTo: HTTP_ROUTE
    match: {routeConfiguration: {portNumber: 80, vhost: {name: "web.shop.svc.cluster.local:80"}}}
    patch:
      operation: INSERT_FIRST
      value: {name: teapot, match: {prefix: /teapot}, direct_response: {status: 418}}
"""


def _snapshot(*documents: str) -> Snapshot:
    store = Store()
    for document in yaml.safe_load_all((DATA / "sidecar-mesh.yaml").read_text()):
        store.apply(document)
    for text in documents:
        for document in yaml.safe_load_all(text):
            store.apply(document)
    return build_snapshot(store, "v1")


def _generate(snapshot: Snapshot, type_url: str, message: Any, labels: dict[str, str] | None = None,
              names: list[str] | None = None, node: str = SIDECAR_NODE) -> dict[str, Any]:
    proxy = proxy_from_node(node, {"LABELS": labels or {"app": "web"}})
    return {r.name: message.FromString(r.value) for r in SIDECAR[type_url](snapshot, proxy, names, ResourceCache())}


def _http_filters(listener: listener_pb2.Listener) -> list[str]:
    hcm = hcm_pb2.HttpConnectionManager()
    chain = next(c for c in listener.filter_chains if any(f.name.endswith("http_connection_manager") for f in c.filters))
    chain.filters[-1].typed_config.Unpack(hcm)
    return [f.name for f in hcm.http_filters]


def test_patches_apply_to_the_selected_sidecar() -> None:
    snapshot = _snapshot(LUA)
    listeners = _generate(snapshot, types.LISTENER, listener_pb2.Listener)
    filters = _http_filters(listeners["0.0.0.0_80"])
    assert filters[-2:] == ["envoy.filters.http.lua", "envoy.filters.http.router"]
    # Inbound listeners are SIDECAR_INBOUND: the patch's context leaves them alone.
    assert "envoy.filters.http.lua" not in str(listeners["virtualInbound"])
    clusters = _generate(snapshot, types.CLUSTER, cluster_pb2.Cluster)
    assert clusters[WEB].connect_timeout == duration_pb2.Duration(seconds=7)
    assert clusters[WEB].per_connection_buffer_limit_bytes.value == 1024
    assert "BlackHoleCluster" not in clusters and clusters["extra"].type == cluster_pb2.Cluster.STATIC
    routes = _generate(snapshot, types.ROUTE, route_pb2.RouteConfiguration, names=["80"])
    host = next(h for h in routes["80"].virtual_hosts if h.name == "web.shop.svc.cluster.local:80")
    assert [h.header.key for h in host.response_headers_to_add] == ["x-vhost"]
    assert host.routes[0].name == "teapot" and host.routes[0].direct_response.status == 418
    other = next(h for h in routes["80"].virtual_hosts if h.name != host.name)
    assert not other.response_headers_to_add and all(r.name != "teapot" for r in other.routes)


def test_a_proxy_the_selector_misses_gets_the_generators_config() -> None:
    snapshot, plain = _snapshot(LUA), _snapshot()
    for type_url, message in ((types.LISTENER, listener_pb2.Listener), (types.CLUSTER, cluster_pb2.Cluster)):
        assert _generate(snapshot, type_url, message, labels={"app": "db"}) == \
            _generate(plain, type_url, message, labels={"app": "db"})


def test_root_namespace_filters_come_first_by_priority() -> None:
    def header_filter(name: str, namespace: str, priority: int, value: str) -> str:
        return f"""
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  priority: {priority}
  configPatches:
  - applyTo: ROUTE_CONFIGURATION
    match: {{routeConfiguration: {{portNumber: 80}}}}
    patch: {{operation: MERGE, value: {{request_headers_to_add: [{{header: {{key: x-order, value: {value}}}}}]}}}}
"""
    snapshot = _snapshot(header_filter("a", "shop", 5, "local"), header_filter("b", "istio-system", 0, "root"),
                         header_filter("c", "other", 0, "elsewhere"))
    config = _generate(snapshot, types.ROUTE, route_pb2.RouteConfiguration, names=["80"])["80"]
    assert [h.header.value for h in config.request_headers_to_add] == ["root", "local"]


def test_merge_replaces_durations_and_lists_when_asked() -> None:
    cluster = cluster_pb2.Cluster(connect_timeout=duration_pb2.Duration(seconds=1, nanos=5))
    cluster.dns_lookup_family = cluster_pb2.Cluster.V4_ONLY
    cluster.load_assignment.cluster_name = "x"
    cluster.transport_socket_matches.add(name="a")
    merge(cluster, cluster_pb2.Cluster(connect_timeout=duration_pb2.Duration(seconds=2),
                                       transport_socket_matches=[cluster_pb2.Cluster.TransportSocketMatch(name="b")]))
    assert cluster.connect_timeout == duration_pb2.Duration(seconds=2)  # not 2.000000005 s
    assert [m.name for m in cluster.transport_socket_matches] == ["a", "b"]
    assert cluster.load_assignment.cluster_name == "x" and cluster.dns_lookup_family == cluster_pb2.Cluster.V4_ONLY
    merge(cluster, cluster_pb2.Cluster(transport_socket_matches=[cluster_pb2.Cluster.TransportSocketMatch(name="c")]),
          "MERGE_AND_REPLACE_LIST")
    assert [m.name for m in cluster.transport_socket_matches] == ["c"]


def _object(patch: str, spec_extra: str = "") -> dict[str, Any]:
    document = yaml.safe_load(f"""
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {{name: bad, namespace: shop}}
spec:
  {spec_extra}
  configPatches:
  - {patch}
""")
    assert isinstance(document, dict)
    return document


@pytest.mark.parametrize(("patch", "message"), [
    ("{patch: {operation: MERGE, value: {}}}", "Envoy filter: missing applyTo"),
    ("{applyTo: CLUSTER}", "Envoy filter: missing patch"),
    ("{applyTo: CLUSTER, patch: {value: {}}}", "Envoy filter: missing patch operation"),
    ("{applyTo: CLUSTER, patch: {operation: MERGE}}", "Envoy filter: missing patch value for non-remove operation"),
    ("{applyTo: CLUSTER, match: {listener: {}}, patch: {operation: REMOVE}}",
     "Envoy filter: applyTo for cluster class objects cannot have non cluster match"),
    ("{applyTo: LISTENER, match: {cluster: {}}, patch: {operation: REMOVE}}",
     "Envoy filter: applyTo for listener class objects cannot have non listener match"),
    ("{applyTo: VIRTUAL_HOST, match: {cluster: {}}, patch: {operation: REMOVE}}",
     "Envoy filter: applyTo for http route class objects cannot have non route configuration match"),
    ("{applyTo: HTTP_FILTER, match: {listener: {filterChain: {filter: {}}}}, patch: {operation: REMOVE}}",
     "Envoy filter: filter match has no name to match on"),
    ("{applyTo: HTTP_FILTER, match: {listener: {filterChain: {filter: {name: envoy.filters.network.tcp_proxy, "
     "subFilter: {name: x}}}}}, patch: {operation: REMOVE}}",
     "Envoy filter: subfilter match requires filter match with envoy.filters.network.http_connection_manager"),
    ("{applyTo: NETWORK_FILTER, match: {listener: {filterChain: {filter: {name: "
     "envoy.filters.network.http_connection_manager, subFilter: {name: x}}}}}, patch: {operation: REMOVE}}",
     "Envoy filter: subfilter match can be used with applyTo HTTP_FILTER only"),
    ("{applyTo: CLUSTER, match: {proxy: {proxyVersion: '(1'}}, patch: {operation: REMOVE}}",
     "Envoy filter: invalid regex for proxy version"),
    ("{applyTo: HTTP_FILTER, patch: {operation: ADD, value: {name: x, typed_config: "
     "{'@type': type.googleapis.com/envoy.extensions.filters.http.nothing.v3.Nothing}}}}",
     "referenced type unknown: envoy.extensions.filters.http.nothing.v3.Nothing"),
    ("{applyTo: CLUSTER, patch: {operation: MERGE, value: {connect_timeout: soon}}}",
     "value: not a envoy.config.cluster.v3.Cluster"),
    ("{applyTo: BOOTSTRAP, patch: {operation: MERGE, value: {}}}", "applyTo: BOOTSTRAP is not implemented by this istiod"),
    ("{applyTo: LISTENER, match: {context: WAYPOINT}, patch: {operation: REMOVE}}",
     "WAYPOINT patches are not implemented by this istiod"),
    ("{applyTo: CLUSTER, match: {proxy: {metadata: {a: b}}}, patch: {operation: REMOVE}}",
     "metadata is not supported by this istiod"),
])
def test_refused_with_istios_messages(patch: str, message: str) -> None:
    store = Store()
    with pytest.raises(ConversionError, match=message.replace("(", r"\(")):
        store.apply(_object(patch))


def test_target_refs_refused_by_name() -> None:
    document = _object("{applyTo: CLUSTER, patch: {operation: REMOVE}}",
                       "targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: gw}]")
    with pytest.raises(ConversionError, match="targetRefs is not supported by this istiod"):
        Store().apply(document)

"""VirtualService delegation merged as istiod's mergeHTTPRoutes: a root's delegating route replaced
by the delegate's routes (matches merged, conflicts left out, unset settings from the root), the
delegate's exportTo honoured, and a change of the delegate alone changing the root's routes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from envoy.config.route.v3 import route_pb2

from istiod.model.builder import build_snapshot
from istiod.model.config.common import MatchKind, StringMatch
from istiod.model.config.delegate import _conflict
from istiod.model.config.networking import HTTPMatch
from istiod.model.mesh import MeshConfig
from istiod.model.proxy import proxy_from_node
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import SIDECAR

DATA = Path(__file__).parent / "data"
WEB = "web.shop.svc.cluster.local"
NODE = "sidecar~127.0.0.31~web-1.shop~shop.svc.cluster.local"

ROOT = """
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: web, namespace: shop}
spec:
  hosts: [web]
  http:
  - name: api
    match: [{uri: {prefix: /api}, headers: {x-team: {exact: a}}}]
    timeout: 5s
    delegate: {name: api, namespace: team}
  - name: hidden
    match: [{uri: {prefix: /hidden}}]
    delegate: {name: private, namespace: team}
  - name: missing
    delegate: {name: nowhere}
  - name: rest
    route: [{destination: {host: web}}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: api, namespace: team}
spec:
  http:
  - name: v2
    match: [{uri: {prefix: /api/v2}, name: two}]
    timeout: 1s
    route: [{destination: {host: rpc.shop.svc.cluster.local, port: {number: 7070}}}]
  - name: wider
    match: [{uri: {prefix: /other}}]
    route: [{destination: {host: rpc.shop.svc.cluster.local}}]
  - name: all
    route: [{destination: {host: db.shop.svc.cluster.local, port: {number: 5432}}}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: private, namespace: team}
spec:
  exportTo: ["."]
  http:
  - route: [{destination: {host: db.shop.svc.cluster.local}}]
"""


def _store(extra: str) -> Store:
    store = Store()
    for document in [*yaml.safe_load_all((DATA / "sidecar-mesh.yaml").read_text()), *yaml.safe_load_all(extra)]:
        store.apply(document)
    return store


def _routes(snapshot: Any) -> dict[str, Any]:
    resources = SIDECAR[types.ROUTE](snapshot, proxy_from_node(NODE, {}), ["80"], ResourceCache())
    config = route_pb2.RouteConfiguration.FromString(resources[0].value)
    host = next(h for h in config.virtual_hosts if h.name == f"{WEB}:80")
    return {r.name: r for r in host.routes}


def test_a_delegating_route_is_replaced_by_the_delegates_routes() -> None:
    routes = _routes(build_snapshot(_store(ROOT), "v1"))
    # `wider` widens the root's /api match: a conflict, left out; `hidden`'s delegate is private to
    # its namespace and `missing`'s does not exist: both delegating routes are left out.
    assert list(routes) == ["api-v2.two", "api-all", "rest"]
    v2, everything = routes["api-v2.two"], routes["api-all"]
    assert v2.match.prefix == "/api/v2" and [(h.name, h.string_match.exact) for h in v2.match.headers] == [
        ("x-team", "a")]
    assert v2.route.cluster == "outbound|7070||rpc.shop.svc.cluster.local"
    assert v2.route.timeout.seconds == 1  # the delegate's own
    # No match of its own: the root's; no timeout of its own: the root's.
    assert everything.match.prefix == "/api" and everything.route.timeout.seconds == 5
    assert everything.route.cluster == "outbound|5432||db.shop.svc.cluster.local"


def test_a_delegate_change_alone_changes_the_roots_routes() -> None:
    store = _store(ROOT)
    before = build_snapshot(store, "v1")
    changed = ROOT.split("---")[1].replace("/api/v2", "/api/v3")
    change = store.apply(yaml.safe_load(changed))
    assert change is not None
    after = build_snapshot(store, "v2", before, [change.key])
    assert "api-v2.two" in _routes(before)
    assert _routes(after)["api-v2.two"].match.prefix == "/api/v3"
    assert after.config.virtual_services != before.config.virtual_services


def test_a_delegate_without_export_to_takes_the_mesh_default() -> None:
    """defaultVirtualServiceExportTo `.`: the team's delegate `api` is no longer seen by the root
    in shop; a snapshot built on the previous one with another mesh default merges again."""
    store = _store(ROOT)
    private = MeshConfig(default_virtual_service_export_to=(".",))
    before = build_snapshot(store, "v1")
    after = build_snapshot(store, "v2", before, [], private)
    assert list(_routes(before)) == ["api-v2.two", "api-all", "rest"]
    assert list(_routes(after)) == ["rest"]
    assert list(_routes(build_snapshot(store, "v3", after, [], MeshConfig()))) == ["api-v2.two", "api-all", "rest"]
    assert list(_routes(build_snapshot(store, "v1", mesh=MeshConfig(default_virtual_service_export_to=("shop",))))) == \
        ["api-v2.two", "api-all", "rest"]


def test_conflicts_as_istiods_has_conflict() -> None:
    def uri(kind: MatchKind, value: str) -> HTTPMatch:
        return HTTPMatch(uri=StringMatch(kind, value))

    exact, prefix, regex = MatchKind.EXACT, MatchKind.PREFIX, MatchKind.REGEX
    assert not _conflict(uri(prefix, "/a"), uri(prefix, "/a/b")) and _conflict(uri(prefix, "/a/b"), uri(prefix, "/a"))
    assert not _conflict(uri(prefix, "/a"), uri(exact, "/a/x")) and _conflict(uri(exact, "/a"), uri(prefix, "/a"))
    assert _conflict(uri(regex, "/a.*"), uri(prefix, "/a")) and _conflict(uri(prefix, "/a"), uri(regex, "/a.*"))
    assert not _conflict(HTTPMatch(), uri(regex, "/a.*"))
    assert _conflict(HTTPMatch(port=80), HTTPMatch(port=81)) and not _conflict(HTTPMatch(port=80), HTTPMatch())
    assert _conflict(HTTPMatch(gateways=("a/gw",)), HTTPMatch(gateways=("b/gw",)))
    assert _conflict(HTTPMatch(source_labels=(("app", "a"),)), HTTPMatch(source_labels=(("app", "b"),)))
    assert _conflict(HTTPMatch(source_namespace="a"), HTTPMatch())  # the root's namespace must be kept
    assert _conflict(HTTPMatch(ignore_uri_case=True), HTTPMatch())

"""Proxyless resources made once per snapshot for every proxy of the same namespace and labels
(istiod.xds.gen.shared_by_name): shared only where the output is the same, made anew after a change."""

from __future__ import annotations

from pathlib import Path

import yaml

from istiod.model.builder import build_snapshot
from istiod.model.proxy import Proxy, proxy_from_node
from istiod.model.snapshot import Snapshot
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen import PROXYLESS_GRPC, SIDECAR

DATA = Path(__file__).parent / "data"
HOST = "reviews.demo.svc.cluster.local"
ROUTE = f"outbound|9080||{HOST}"
# What a proxyless client of the fixture asks for, of each type; an inbound listener is the proxy's own.
NAMES = {
    types.LISTENER: ["reviews:9080", f"{HOST}:9080", "missing.demo:80", "xds.istio.io/grpc/lds/inbound/0.0.0.0:9080"],
    types.ROUTE: [ROUTE, "outbound|9090||ratings.demo.svc.cluster.local"],
    types.CLUSTER: [ROUTE, f"outbound|9080|v2|{HOST}", f"outbound|9080|nosuch|{HOST}"],
    types.ENDPOINT: [ROUTE, f"outbound|9080|v1|{HOST}"],
}


def _proxy(pod: str, namespace: str, ip: str, labels: dict[str, str] | None = None) -> Proxy:
    return proxy_from_node(f"sidecar~{ip}~{pod}.{namespace}~{namespace}.svc.cluster.local",
                           {"GENERATOR": "grpc", "LABELS": labels or {}})


def _store() -> Store:
    store = Store()
    for document in yaml.safe_load_all((DATA / "routing-mesh.yaml").read_text()):
        store.apply(document)
    return store


def _made(snapshot: Snapshot, proxy: Proxy, cache: ResourceCache) -> dict[str, list[Resource]]:
    return {t: PROXYLESS_GRPC[t](snapshot, proxy, names, cache) for t, names in NAMES.items()}


def _content(made: dict[str, list[Resource]]) -> dict[str, list[tuple[str, bytes]]]:
    return {t: [(r.name, r.value) for r in resources] for t, resources in made.items()}


def test_proxies_that_differ_get_what_they_would_alone_in_any_order() -> None:
    snapshot = build_snapshot(_store(), "v1")
    proxies = [
        _proxy("productpage-1", "demo", "10.0.9.9", {"app": "productpage"}),  # a VirtualService route is its only
        _proxy("reviews-v1", "demo", "10.0.0.1", {"app": "reviews", "version": "v1"}),  # serves 9080 itself
        _proxy("client", "demo", "10.0.9.7"),
        _proxy("client", "other", "10.0.9.8"),  # a bare name means nothing from another namespace
    ]
    alone = [_content(_made(snapshot, p, ResourceCache())) for p in proxies]
    for order in (proxies, proxies[::-1]):
        cache = ResourceCache()
        shared = {p.id: _content(_made(snapshot, p, cache)) for p in order}
        assert [shared[p.id] for p in proxies] == alone
    # What sets them apart is in the fixture: the cases above are not all the same.
    assert alone[0][types.ROUTE] != alone[2][types.ROUTE]  # sourceLabels
    assert alone[2][types.LISTENER] != alone[3][types.LISTENER]  # the bare name; inbound of its own
    assert alone[1][types.LISTENER][-1][0].startswith("xds.istio.io/grpc/lds/inbound/")


def test_proxies_alike_share_until_a_change_then_all_get_the_new() -> None:
    store = _store()
    changed: list[ObjectKey] = []
    store.subscribe(lambda change: changed.append(change.key))
    cache = ResourceCache()
    one, two = _proxy("client-1", "demo", "10.0.9.1"), _proxy("client-2", "demo", "10.0.9.2")
    v1 = build_snapshot(store, "v1")
    first = _made(v1, one, cache)
    second = _made(v1, two, cache)
    for type_url in (types.ROUTE, types.CLUSTER, types.ENDPOINT):
        assert all(a is b for a, b in zip(first[type_url], second[type_url], strict=True))

    rule = next(d for d in yaml.safe_load_all((DATA / "routing-mesh.yaml").read_text()) if d["kind"] == "DestinationRule")
    rule["spec"]["trafficPolicy"]["loadBalancer"] = {"simple": "ROUND_ROBIN"}
    store.apply(rule)
    v2 = build_snapshot(store, "v2", previous=v1, changed=list(changed))
    fresh = _content(_made(build_snapshot(store, "fresh"), one, ResourceCache()))
    after = [_content(_made(v2, proxy, cache)) for proxy in (one, two)]
    assert after == [fresh, fresh]
    assert after[0][types.ROUTE] != _content(first)[types.ROUTE]  # the rule's consistentHash is gone


def test_sidecars_with_pod_labels_of_their_own_share_what_no_selector_tells_apart() -> None:
    """Every sidecar reports its pod's labels (pod-template-hash and the like): of them only those some
    config object selects by set proxies apart, so one copy of each route configuration serves them all."""
    snapshot = build_snapshot(_store(), "v1")
    cache = ResourceCache()
    pods = [_sidecar(f"client-{i}", {"app": "client", "pod-template-hash": f"h{i}"}) for i in range(3)]
    selected = _sidecar("productpage-1", {"app": "productpage", "pod-template-hash": "h9"})  # a sourceLabels match
    made = {p.id: {t: SIDECAR[t](snapshot, p, None, cache) for t in (types.ROUTE, types.CLUSTER, types.LISTENER)}
            for p in (*pods, selected)}
    first = made[pods[0].id]
    for pod in pods[1:]:
        for type_url in (types.ROUTE, types.CLUSTER):
            assert all(a is b for a, b in zip(first[type_url], made[pod.id][type_url], strict=True))
    # The one a VirtualService's sourceLabels select gets its own, as it would alone.
    alone = {t: [(r.name, r.value) for r in SIDECAR[t](snapshot, selected, None, ResourceCache())] for t in (types.ROUTE,)}
    assert [(r.name, r.value) for r in made[selected.id][types.ROUTE]] == alone[types.ROUTE]
    assert alone[types.ROUTE] != [(r.name, r.value) for r in first[types.ROUTE]]


def _sidecar(pod: str, labels: dict[str, str]) -> Proxy:
    return proxy_from_node(f"sidecar~10.0.9.{len(pod)}~{pod}.demo~demo.svc.cluster.local", {"LABELS": labels})

"""Benchmark: ztunnel's WDS (Address resources) on a mesh of many pods. Prints what one snapshot costs
to make for every ztunnel (first, after one pod changed, after a Service of another namespace
changed) and what each ztunnel costs after one pod changed (its resources compared, one sent; for
the next ones holding the same, the comparison is reused).

    python bench/wds.py [--pods 10000] [--services 100]
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

from istiod.model.builder import build_snapshot
from istiod.model.proxy import proxy_from_node
from istiod.model.snapshot import Snapshot
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Store
from istiod.xds import delta, types
from istiod.xds.cache import ResourceCache
from istiod.xds.connection import WatchedResource
from istiod.xds.gen.ztunnel import addresses

PROXY = proxy_from_node("ztunnel~10.0.0.1~ztunnel-0.istio-system~istio-system.svc.cluster.local", {})


def pod(i: int, services: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p{i}", "namespace": "a", "labels": {"app": f"s{i % services}"}},
            "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}]},
            "status": {"phase": "Running", "podIP": f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def service(name: str, namespace: str, ip: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterIP": ip, "selector": {"app": name}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}


def timed(what: str, snapshot: Snapshot, cache: ResourceCache) -> None:
    started = time.perf_counter()
    made = addresses(snapshot, PROXY, None, cache)
    print(f"{what}: {(time.perf_counter() - started) * 1e3:.1f} ms ({len(made)} resources)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=10000)
    parser.add_argument("--services", type=int, default=100)
    args = parser.parse_args()
    store = Store()
    for namespace in ("a", "b"):
        store.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    for s in range(args.services):
        store.apply(service(f"s{s}", "a", f"10.96.{s // 250}.{s % 250 + 1}"))
    for i in range(args.pods):
        store.apply(pod(i, args.services))
    cache = ResourceCache()
    snapshot = build_snapshot(store, "v1")
    timed("table, first", snapshot, cache)
    watched, other = WatchedResource(types.ADDRESS, None), WatchedResource(types.ADDRESS, None)
    delta.respond(watched, snapshot, addresses(snapshot, PROXY, None, cache), always=True)
    other.sent = watched.sent  # another ztunnel, holding the same

    changed = copy.deepcopy(store.get(ObjectKey("Pod", "a", "p5")).raw)  # type: ignore[union-attr]
    changed["status"]["conditions"][0]["status"] = "False"
    store.apply(changed)
    snapshot = build_snapshot(store, "v2", snapshot, [ObjectKey("Pod", "a", "p5")])
    timed("table, one pod changed", snapshot, cache)
    started = time.perf_counter()
    response = delta.respond(watched, snapshot, addresses(snapshot, PROXY, None, cache))
    assert response is not None
    print(f"per ztunnel, one pod changed: {(time.perf_counter() - started) * 1e3:.2f} ms "
          f"({len(response.resources)} resource sent)")
    started = time.perf_counter()
    delta.respond(other, snapshot, addresses(snapshot, PROXY, None, cache))
    print(f"per further ztunnel holding the same: {(time.perf_counter() - started) * 1e3:.2f} ms "
          "(the difference worked out once)")

    store.apply(service("other", "b", "10.96.200.1"))
    snapshot = build_snapshot(store, "v3", snapshot, [ObjectKey("Service", "b", "other")])
    timed("table, a Service of another namespace added", snapshot, cache)


if __name__ == "__main__":
    main()

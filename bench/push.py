"""Benchmark: snapshot builds and per-proxy generation at mesh scale. Prints medians and ratios.

    python bench/push.py [--services 1000] [--pods-per-service 10] [--proxies 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable

from istiod.model.builder import build_snapshot
from istiod.model.proxy import proxy_from_node
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import PROXYLESS_GRPC


def populate(store: Store, services: int, pods: int) -> None:
    for s in range(services):
        ns = f"ns{s % 50}"
        store.apply({"kind": "Service", "metadata": {"name": f"svc{s}", "namespace": ns},
                     "spec": {"selector": {"app": f"svc{s}"}, "ports": [{"name": "grpc", "port": 7070}]}})
        for p in range(pods):
            store.apply({"kind": "Pod", "metadata": {"name": f"svc{s}-{p}", "namespace": ns, "labels": {"app": f"svc{s}"}},
                         "spec": {"containers": [{"ports": [{"containerPort": 7070}]}]},
                         "status": {"podIP": f"10.{s // 250}.{s % 250}.{p + 1}", "conditions": [{"type": "Ready", "status": "True"}]}})


def median_ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--pods-per-service", type=int, default=10)
    parser.add_argument("--proxies", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    tracemalloc.start()
    store = Store()
    populate(store, args.services, args.pods_per_service)
    snapshot = build_snapshot(store, "v0")
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"mesh: {args.services} services, {args.services * args.pods_per_service} pods; "
          f"store + snapshot {size / 2**20:.1f} MiB")

    full = median_ms(lambda: build_snapshot(store, "v1", snapshot, None), args.rounds)
    one_pod = [ObjectKey("Pod", "ns0", "svc0-0")]
    incremental = median_ms(lambda: build_snapshot(store, "v1", snapshot, one_pod), args.rounds)
    print(f"snapshot build: full {full:.1f} ms, one pod changed {incremental:.1f} ms (x{full / incremental:.1f} faster)")

    names = [f"outbound|7070||svc{s}.ns{s % 50}.svc.cluster.local" for s in range(0, args.services, args.services // 20)]
    proxies = [proxy_from_node(f"sidecar~10.99.{i // 250}.{i % 250}~p{i}.ns0~ns0.svc.cluster.local", {"GENERATOR": "grpc"})
               for i in range(args.proxies)]

    def push(cache_for: Callable[[], ResourceCache]) -> None:
        for proxy in proxies:
            cache = cache_for()
            for type_url in (types.CLUSTER, types.ENDPOINT):
                PROXYLESS_GRPC[type_url](snapshot, proxy, names, cache)

    unshared = median_ms(lambda: push(ResourceCache), args.rounds)
    shared = ResourceCache()
    shared_ms = median_ms(lambda: push(lambda: shared), args.rounds)
    print(f"push of CDS+EDS ({len(names)} clusters x {args.pods_per_service} endpoints) to {args.proxies} proxies: "
          f"built per proxy {unshared:.1f} ms, serialized once and shared {shared_ms:.1f} ms (x{unshared / shared_ms:.1f} faster)")


if __name__ == "__main__":
    main()

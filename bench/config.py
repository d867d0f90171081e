"""Benchmark: validating Istio config into the store, and the scoping lookups a push makes per
proxy. Prints rates and medians.

    python bench/config.py [--objects 2000] [--namespaces 50] [--lookups 20000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from istiod.model.config import ConfigSet
from istiod.model.config.scope import sidecar_allows
from istiod.sources.store import Store


def virtual_service(i: int, ns: str) -> dict:
    return {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": f"vs{i}", "namespace": ns},
            "spec": {"hosts": [f"svc{i}"], "http": [
                {"match": [{"uri": {"regex": f"/svc{i}\\.v1\\..*"}}, {"headers": {"end-user": {"exact": "jason"}}}],
                 "route": [{"destination": {"host": f"svc{i}", "subset": "v2"}, "weight": 90},
                           {"destination": {"host": f"svc{i}", "subset": "v1"}, "weight": 10}],
                 "timeout": "1.5s", "retries": {"attempts": 3, "perTryTimeout": "500ms", "retryOn": "unavailable"}}]}}


def destination_rule(i: int, ns: str) -> dict:
    return {"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule", "metadata": {"name": f"dr{i}", "namespace": ns},
            "spec": {"host": f"svc{i}", "trafficPolicy": {"loadBalancer": {"simple": "LEAST_REQUEST"}},
                     "subsets": [{"name": "v1", "labels": {"version": "v1"}}, {"name": "v2", "labels": {"version": "v2"}}]}}


def sidecar(ns: str) -> dict:
    return {"apiVersion": "networking.istio.io/v1", "kind": "Sidecar", "metadata": {"name": "default", "namespace": ns},
            "spec": {"egress": [{"hosts": ["./*", "istio-system/*"]}]}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--namespaces", type=int, default=50)
    parser.add_argument("--lookups", type=int, default=20000)
    args = parser.parse_args()
    bodies = []
    for i in range(args.objects):
        ns = f"ns{i % args.namespaces}"
        bodies += [virtual_service(i, ns), destination_rule(i, ns)]
    bodies += [sidecar(f"ns{n}") for n in range(args.namespaces)]

    store = Store()
    started = time.perf_counter()
    for body in bodies:
        store.apply(body)
    took = time.perf_counter() - started
    print(f"validate+store: {len(bodies)} objects in {took:.2f}s = {len(bodies) / took:,.0f} objects/s")

    config = ConfigSet.collect(store)
    samples = []
    for i in range(args.lookups):
        n = i % args.objects
        proxy_ns, host = f"ns{(n + 1) % args.namespaces}", f"svc{n}.ns{n % args.namespaces}.svc.cluster.local"
        t0 = time.perf_counter()
        sidecar_allows(config.sidecar_for(proxy_ns, {}, "istio-system"), f"ns{n % args.namespaces}", host)
        config.virtual_service_for_host(proxy_ns, host)
        config.destination_rule_for(proxy_ns, {}, host, f"ns{n % args.namespaces}", "istio-system")
        samples.append(time.perf_counter() - t0)
    print(f"per-host lookups (sidecar, virtual service, destination rule) over {len(bodies)} objects: "
          f"median {statistics.median(samples) * 1e6:,.0f} us")


if __name__ == "__main__":
    main()

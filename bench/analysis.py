"""Benchmark: one round of the config analyzers (`istiod analyze`, and the in-cluster analysis the
elected replica runs), over services with pods, VirtualServices and DestinationRules whose
subsets half select nothing. Prints the time a round takes.

    python bench/analysis.py [--services 5000] [--pods-per-service 5] [--namespaces 50]
"""

from __future__ import annotations

import argparse
import time

from istiod.model.config.analysis import KUBE_KINDS, Objects, Resource, analyze
from istiod.model.config.kinds import BY_KIND


def cluster(services: int, pods: int, namespaces: int) -> list[Resource]:
    found = [Resource("Namespace", "", f"ns{n}", {"metadata": {"labels": {"istio-injection": "enabled"}}})
             for n in range(namespaces)]
    for i in range(services):
        ns = f"ns{i % namespaces}"
        found.append(Resource("Service", ns, f"svc{i}", {"spec": {"selector": {"app": f"a{i}"},
                                                                 "ports": [{"name": "http", "port": 80}]}}))
        found += [Resource("Pod", ns, f"p{i}-{k}", {"metadata": {"labels": {"app": f"a{i}", "version": f"v{k % 2}"}},
                                                    "spec": {"containers": [{"name": "istio-proxy", "image": "proxy"}]}})
                  for k in range(pods)]
        found.append(Resource("VirtualService", ns, f"vs{i}", {"spec": {"hosts": [f"svc{i}"], "http": [
            {"route": [{"destination": {"host": f"svc{i}", "subset": "v1"}}]}]}}))
        found.append(Resource("DestinationRule", ns, f"dr{i}", {"spec": {"host": f"svc{i}", "subsets": [
            {"name": "v1", "labels": {"version": "v1"}}, {"name": "v9", "labels": {"version": "v9"}}]}}))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=5000)
    parser.add_argument("--pods-per-service", type=int, default=5)
    parser.add_argument("--namespaces", type=int, default=50)
    args = parser.parse_args()
    resources = cluster(args.services, args.pods_per_service, args.namespaces)
    start = time.perf_counter()
    messages = analyze(Objects(resources, set(BY_KIND) | set(KUBE_KINDS)))
    took = time.perf_counter() - start
    print(f"analysis: {args.services} services, {args.services * args.pods_per_service} pods, "
          f"{2 * args.services} Istio objects -> {len(messages)} messages in {took:.2f} s")


if __name__ == "__main__":
    main()

"""What Istio's own istiod and ours send a sidecar in r1/zone-a for clusters with localityLbSetting
(a dev tool: it needs Istio's pilot-discovery, built by shared/reference-istiod/build.sh).

    python bench/locality_compare.py [--reference PATH] [--mesh tests/data/locality-compare-mesh.yaml]

Both istiods run on one real kube-apiserver holding the mesh (bench/wds_compare.py's side_by_side); a
SotW ADS client as client-1's sidecar asks each for CDS, then EDS of the clusters of the mesh's
services. Prints, per cluster, its locality LB config and per endpoint its locality, priority and
locality weight, side by side, and exits 1 if anything differs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import struct_pb2

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))
from adsexchange import until_quiet  # noqa: E402
from reference import add_reference_argument, reference_binary  # noqa: E402
from wds_compare import side_by_side  # noqa: E402

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
NODE = "sidecar~10.244.0.30~client-1.demo~demo.svc.cluster.local"
HOSTS = ("echo.demo.svc.cluster.local", "spread.demo.svc.cluster.local")
QUIET = 3.0


async def held(address: str) -> dict[str, Any]:
    """cluster name -> (locality LB config, {address: (locality, priority, weight)})."""
    metadata = struct_pb2.Struct()
    metadata.update({"NAME": "client-1", "NAMESPACE": "demo", "INSTANCE_IPS": "10.244.0.30", "CLUSTER_ID": "Kubernetes",
                     "ISTIO_VERSION": "1.31.0", "SERVICE_ACCOUNT": "client", "GENERATOR": "",
                     "LABELS": {"app": "client", "version": "v1"}, "NODE_NAME": "node-a"})
    node = base_pb2.Node(id=NODE, metadata=metadata, locality=base_pb2.Locality(region="r1", zone="zone-a"))
    clusters: dict[str, str] = {}
    result: dict[str, Any] = {}

    def answer(response: discovery_pb2.DiscoveryResponse) -> tuple[list[str], list[discovery_pb2.DiscoveryRequest]]:
        if response.type_url == CLUSTER:
            for resource in response.resources:
                cluster = cluster_pb2.Cluster.FromString(resource.value)
                if cluster.name.endswith(HOSTS):
                    clusters[cluster.name] = "locality_weighted_lb_config" if cluster.common_lb_config.HasField(
                        "locality_weighted_lb_config") else "-"
            return [], [discovery_pb2.DiscoveryRequest(type_url=ENDPOINT, resource_names=sorted(clusters))]
        for resource in response.resources:
            assignment = endpoint_pb2.ClusterLoadAssignment.FromString(resource.value)
            result[assignment.cluster_name] = (clusters.get(assignment.cluster_name), {
                e.endpoint.address.socket_address.address: (
                    "/".join(p for p in (g.locality.region, g.locality.zone, g.locality.sub_zone) if p),
                    g.priority, g.load_balancing_weight.value)
                for g in assignment.endpoints for e in g.lb_endpoints})
        return sorted(clusters), []

    await until_quiet(address, [discovery_pb2.DiscoveryRequest(type_url=CLUSTER, node=node)], answer, QUIET)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_reference_argument(parser)
    parser.add_argument("--mesh", type=Path,
                        default=Path(__file__).parent.parent / "tests" / "data" / "locality-compare-mesh.yaml")
    args = parser.parse_args()
    binary = reference_binary(parser, args)
    with side_by_side(binary, args.mesh, "locality-compare-") as (reference_addr, our_addr):
        istio, ours = asyncio.run(held(reference_addr)), asyncio.run(held(our_addr))
    differences = 0
    for name in sorted(set(istio) | set(ours)):
        same = istio.get(name) == ours.get(name)
        differences += not same
        print(f"{'  ' if same else '≠ '}{name}")
        for side, held_by in (("istio", istio), ("ours ", ours)):
            config, endpoints = held_by.get(name, (None, {}))
            print(f"    {side} cluster: {config}; " + ", ".join(
                f"{address} {where} p{priority} w{weight}" for address, (where, priority, weight) in sorted(endpoints.items())))
    print(f"{differences} of {len(set(istio) | set(ours))} clusters differ")
    sys.exit(1 if differences else 0)


if __name__ == "__main__":
    main()

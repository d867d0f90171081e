"""What Istio's own istiod and ours send sidecars of networks n1, n2, n4 and none for a service whose
WorkloadEntries sit in several networks (a dev tool: it needs Istio's pilot-discovery, built by
shared/reference-istiod/build.sh).

    python bench/multinetwork_compare.py [--reference PATH] [--mesh tests/data/multinetwork-compare-mesh.yaml]

Both istiods run on one real kube-apiserver holding the mesh (bench/wds_compare.py's side_by_side),
with the same meshNetworks (n2: two gateways; n4: a CIDR, its gateway a Service labelled
topology.istio.io/network with externalIPs); a SotW ADS client per network (node metadata
NETWORK) asks each for CDS, then the service's EDS. Prints per network each endpoint's address, port,
weight and tlsMode side by side, and exits 1 if anything differs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

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
ECHO = "outbound|80||echo.demo.svc.cluster.local"
# n4's endpoints are those in 10.4.0.0/16 without a network; its gateway is a labelled Service.
MESH_NETWORKS = "networks:\n  n2:\n    gateways:\n    - {address: 192.0.2.2, port: 15443}\n" \
                "    - {address: 192.0.2.3, port: 15443}\n  n4:\n    endpoints: [{fromCidr: 10.4.0.0/16}]\n"
QUIET = 3.0


async def held(address: str, network: str) -> list[tuple[str, int, int, str]]:
    """(address, port, weight, tlsMode) of each endpoint of echo's cluster, as a sidecar of `network` gets them."""
    metadata = struct_pb2.Struct()
    metadata.update({"NAME": "client-1", "NAMESPACE": "demo", "INSTANCE_IPS": "10.244.0.30", "CLUSTER_ID": "Kubernetes",
                     "ISTIO_VERSION": "1.31.0", "SERVICE_ACCOUNT": "client", "GENERATOR": "",
                     "LABELS": {"app": "client"}, **({"NETWORK": network} if network else {})})
    node = base_pb2.Node(id="sidecar~10.244.0.30~client-1.demo~demo.svc.cluster.local", metadata=metadata)
    result: list[tuple[str, int, int, str]] = []

    def answer(response: discovery_pb2.DiscoveryResponse) -> tuple[list[str], list[discovery_pb2.DiscoveryRequest]]:
        if response.type_url == CLUSTER:
            names = [n for n in (cluster_pb2.Cluster.FromString(r.value).name for r in response.resources) if n == ECHO]
            return [], [discovery_pb2.DiscoveryRequest(type_url=ENDPOINT, resource_names=names)]
        for resource in response.resources:
            assignment = endpoint_pb2.ClusterLoadAssignment.FromString(resource.value)
            result[:] = sorted(
                (e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value,
                 e.load_balancing_weight.value,
                 e.metadata.filter_metadata["envoy.transport_socket_match"].fields["tlsMode"].string_value)
                for g in assignment.endpoints for e in g.lb_endpoints)
        return [ECHO], []

    await until_quiet(address, [discovery_pb2.DiscoveryRequest(type_url=CLUSTER, node=node)], answer, QUIET)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_reference_argument(parser)
    parser.add_argument("--mesh", type=Path,
                        default=Path(__file__).parent.parent / "tests" / "data" / "multinetwork-compare-mesh.yaml")
    args = parser.parse_args()
    binary = reference_binary(parser, args)
    networks = ("n1", "n2", "n4", "")
    with side_by_side(binary, args.mesh, "multinetwork-compare-", MESH_NETWORKS) as (reference_addr, our_addr):
        istio = {n: asyncio.run(held(reference_addr, n)) for n in networks}
        ours = {n: asyncio.run(held(our_addr, n)) for n in networks}
    differences = 0
    for network in networks:
        same = istio[network] == ours[network]
        differences += not same
        print(f"{'  ' if same else '≠ '}a sidecar in network {network or '(none)'}:")
        for side, held_by in (("istio", istio), ("ours ", ours)):
            print(f"    {side}: " + ", ".join(f"{a}:{p} w{w} {t or '-'}" for a, p, w, t in held_by[network]))
    print(f"{differences} of {len(networks)} networks differ")
    sys.exit(1 if differences else 0)


if __name__ == "__main__":
    main()

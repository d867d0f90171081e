"""What Istio's own istiod and ours send a ztunnel for the same cluster, field by field (a dev tool:
it needs Istio's pilot-discovery, built by shared/reference-istiod/build.sh, which CI does not have).

    python bench/wds_compare.py [--reference PATH] [--mesh tests/data/ambient-mesh.yaml]

etcd and kube-apiserver are started (the e2e harness), Istio's CRDs installed and the mesh's objects
created through the API (a Pod's status as the kubelet writes it); then Istio's istiod (with
PILOT_ENABLE_AMBIENT=true) and ours in kube mode on that API server, and a delta WDS client as
ztunnel's (wildcard Address and Authorization, ACKing) on each one's plaintext port. Prints each
resource that differs, as the JSON of each side (sorted by name), and exits 1 if any does.
Every process started here is stopped at the end, on failure and Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import grpc
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import json_format, struct_pb2
from kubernetes_asyncio import client

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))
from load import SERVICE_CIDR, Server  # noqa: E402
from e2e.harness import Cluster  # noqa: E402
from e2e.gateway_api_crds import install_gateway_api_crds  # noqa: E402
from e2e.istio_crds import create_istio_object, install_crds  # noqa: E402
from istiod.gen.istio.security import authorization_pb2  # noqa: E402
from istiod.gen.istio.workload import workload_pb2  # noqa: E402
from istiod.kubeapi import api_client  # noqa: E402
from reference import add_reference_argument, reference_binary, start_reference  # noqa: E402
from tests.peers import stop_group  # noqa: E402

ADDRESS = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION = "type.googleapis.com/istio.security.Authorization"
MESSAGES: dict[str, Any] = {ADDRESS: workload_pb2.Address, AUTHORIZATION: authorization_pb2.Authorization}
NODE = "ztunnel~10.244.0.1~ztunnel-x.istio-system~istio-system.svc.cluster.local"
OWNER_GROUPS = {"Job": "batch/v1", "CronJob": "batch/v1"}
GATEWAY_GROUP = "gateway.networking.k8s.io"
GATEWAY_PLURALS = {"GatewayClass": "gatewayclasses", "Gateway": "gateways"}
QUIET = 3.0  # seconds without a response: the client holds all there is


async def create(api: client.ApiClient, body: dict[str, Any]) -> None:
    core, kind, meta = client.CoreV1Api(api), body["kind"], body["metadata"]
    namespace = meta.get("namespace", "")
    if kind == "Namespace":
        if meta["name"] != "istio-system":  # the harness made it
            await core.create_namespace(body)
    elif kind == "Node":
        await core.create_node(body)
    elif kind == "Service":
        await core.create_namespaced_service(namespace, body)
    elif kind == "EndpointSlice":  # Istio's istiod reads endpoints from these, not from Pods
        await client.DiscoveryV1Api(api).create_namespaced_endpoint_slice(namespace, body)
    elif kind == "Pod":
        # The test mesh abbreviates what the API server requires and the translation does not read.
        for owner in meta.get("ownerReferences", []):
            owner.setdefault("apiVersion", OWNER_GROUPS.get(owner["kind"], "apps/v1"))
            owner.setdefault("uid", str(uuid.uuid4()))
        for container in body["spec"]["containers"]:
            container.setdefault("image", "app")
        status = body.pop("status", None)
        await core.create_namespaced_pod(namespace, body)
        if status:
            await core.patch_namespaced_pod_status(meta["name"], namespace, {"status": status})
    elif body["apiVersion"].startswith(f"{GATEWAY_GROUP}/"):
        custom, plural = client.CustomObjectsApi(api), GATEWAY_PLURALS[kind]
        if namespace:
            await custom.create_namespaced_custom_object(GATEWAY_GROUP, "v1", namespace, plural, body)
        else:
            await custom.create_cluster_custom_object(GATEWAY_GROUP, "v1", plural, body)
    else:
        await create_istio_object(api, body)


async def load_mesh(kubeconfig: Path, mesh: Path) -> None:
    api = await api_client(kubeconfig)
    try:
        await install_crds(api)
        await install_gateway_api_crds(api)
        for body in yaml.safe_load_all(mesh.read_text()):
            await create(api, body)
    finally:
        await api.close()


async def held(address: str) -> dict[str, dict[str, Any]]:
    """What a wildcard ztunnel holds from `address` once it is quiet: type -> name -> the resource as JSON."""
    requests: asyncio.Queue[discovery_pb2.DeltaDiscoveryRequest | None] = asyncio.Queue()
    metadata = struct_pb2.Struct()
    metadata.update({"NAME": "ztunnel-x", "NAMESPACE": "istio-system", "INSTANCE_IPS": "10.244.0.1",
                     "NODE_NAME": "node-a", "CLUSTER_ID": "Kubernetes"})
    for type_url in (ADDRESS, AUTHORIZATION):
        requests.put_nowait(discovery_pb2.DeltaDiscoveryRequest(
            type_url=type_url, node=base_pb2.Node(id=NODE, metadata=metadata)))

    async def stream() -> Any:
        while (request := await requests.get()) is not None:
            yield request

    result: dict[str, dict[str, Any]] = {ADDRESS: {}, AUTHORIZATION: {}}
    async with grpc.aio.insecure_channel(address) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources(stream())
        while True:
            try:
                response = await asyncio.wait_for(call.read(), QUIET)
            except asyncio.TimeoutError:
                break
            have = result[response.type_url]
            for name in response.removed_resources:
                have.pop(name, None)
            for resource in response.resources:
                message = MESSAGES[response.type_url].FromString(resource.resource.value)
                have[resource.name] = json_format.MessageToDict(message)
            requests.put_nowait(discovery_pb2.DeltaDiscoveryRequest(type_url=response.type_url,
                                                                    response_nonce=response.nonce))
        requests.put_nowait(None)
        call.cancel()
    return result


def diff(istio: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]]) -> int:
    differences = 0
    for type_url in (ADDRESS, AUTHORIZATION):
        short = type_url.rsplit(".", 1)[-1]
        for name in sorted(istio[type_url].keys() | ours[type_url].keys()):
            theirs, mine = istio[type_url].get(name), ours[type_url].get(name)
            if theirs == mine:
                continue
            differences += 1
            print(f"--- {short} {name}")
            if theirs is None or mine is None:
                print(f"  only {'ours' if theirs is None else 'Istio'}: {json.dumps(theirs or mine, sort_keys=True)}")
                continue
            print_fields(theirs, mine)
    print(f"{sum(len(v) for v in istio.values())} resources from Istio, {sum(len(v) for v in ours.values())} "
          f"from ours; {differences} differ")
    return differences


def waypoints(addresses: dict[str, Any]) -> dict[str, Any]:
    """Each address that has a waypoint: its name -> the waypoint (so agreement shows too)."""
    return {name: (value.get("service") or value.get("workload") or {}).get("waypoint")
            for name, value in addresses.items() if (value.get("service") or value.get("workload") or {}).get("waypoint")}


def print_fields(theirs: dict[str, Any], mine: dict[str, Any]) -> None:
    """The top-level fields where one resource of Istio's and ours differ, side by side."""
    for key in sorted(theirs.keys() | mine.keys()):
        if theirs.get(key) != mine.get(key):
            print(f"  {key}: Istio {json.dumps(theirs.get(key), sort_keys=True)}\n"
                  f"  {' ' * len(key)}  ours  {json.dumps(mine.get(key), sort_keys=True)}")


@contextlib.contextmanager
def side_by_side(binary: str, mesh: Path, prefix: str, mesh_networks: str = "") -> Iterator[tuple[str, str]]:
    """Istio's istiod and ours on one fresh kube-apiserver holding `mesh`: their plaintext xDS
    addresses, once both have listed the cluster and pushed what they built. `mesh_networks`: the
    YAML of a meshNetworks, both istiods' --networksConfig file."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        (workdir / "cluster").mkdir()
        cluster = Cluster(workdir / "cluster", service_cidr=SERVICE_CIDR)
        stack.callback(cluster.stop)
        cluster.start()
        asyncio.run(load_mesh(cluster.kubeconfig, mesh))
        reference, reference_addr, _ = start_reference(binary, cluster.kubeconfig, workdir,
                                                       mesh_networks=mesh_networks or "networks: {}\n")
        stack.callback(stop_group, reference, 10)
        networks: list[str] = []
        if mesh_networks:
            (workdir / "ours-networks.yaml").write_text(mesh_networks)
            networks = ["--networksConfig", str(workdir / "ours-networks.yaml")]
        ours = Server(["--kubeconfig", str(cluster.kubeconfig), *networks], workdir, None, None)
        stack.callback(ours.stop)
        time.sleep(2)
        yield reference_addr, ours.xds_addr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_reference_argument(parser)
    parser.add_argument("--mesh", type=Path, default=Path(__file__).parent.parent / "tests" / "data" / "ambient-mesh.yaml")
    args = parser.parse_args()
    binary = reference_binary(parser, args)
    with side_by_side(binary, args.mesh, "wds-compare-") as (reference_addr, our_addr):
        istio_held, our_held = asyncio.run(held(reference_addr)), asyncio.run(held(our_addr))
        differences = diff(istio_held, our_held)
        for side, held_by in (("Istio", istio_held), ("ours", our_held)):
            print(f"waypoints ({side}):", json.dumps(waypoints(held_by[ADDRESS]), sort_keys=True))
    sys.exit(1 if differences else 0)


if __name__ == "__main__":
    main()

"""The WorkloadEntry Istio's own istiod and ours make for the same VM proxy (a dev tool: it needs
Istio's pilot-discovery, built by shared/reference-istiod/build.sh, which CI does not have).

    python bench/workloadgroup_compare.py [--reference PATH]

etcd and kube-apiserver are started (the e2e harness) with Istio's CRDs, a namespace and the
WorkloadGroup of tests/data/workloadgroup-compare-mesh.yaml; then Istio's istiod and ours in kube mode
on that API server, both with ISTIO_WORKLOAD_ENTRY_VALIDATE_IDENTITY=false (a plaintext ADS client
proves no identity) and PILOT_WORKLOAD_ENTRY_GRACE_PERIOD=2s. A VM-like ADS client connects to each
(its own address, so the entries' names differ only there) with AUTO_REGISTER_GROUP, labels, network,
locality and a PROXY_CONFIG with a readinessProbe, reports healthy, then unhealthy, then leaves.
Prints each side's entry after each step (times, uids and resourceVersions left out, the address
made `<ip>`), and exits 1 if they differ. Every process started here is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2
from kubernetes_asyncio import client

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))
from load import SERVICE_CIDR, Server  # noqa: E402
from e2e.harness import Cluster  # noqa: E402
from istiod.kubeapi import api_client  # noqa: E402
from reference import add_reference_argument, reference_binary, start_reference  # noqa: E402
from tests.peers import stop_group  # noqa: E402
from wds_compare import load_mesh  # noqa: E402

MESH = Path(__file__).parent.parent / "tests" / "data" / "workloadgroup-compare-mesh.yaml"
NAMESPACE, GROUP = "vms", "db"
HEALTH_INFO = "type.googleapis.com/istio.v1.HealthInformation"
CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
VOLATILE = ("creationTimestamp", "resourceVersion", "uid", "generation", "managedFields", "lastProbeTime",
            "lastTransitionTime", "istio.io/connectedAt", "istio.io/disconnectedAt")
CONTROLLER = "istio.io/workloadController"


def _stable(value: Any, ip: str) -> Any:
    """The entry without what differs by time or object identity; the proxy's address as `<ip>`, the
    controlling istiod's name (its pod's) as `<istiod>`."""
    if isinstance(value, dict):
        return {k: "<istiod>" if k == CONTROLLER else _stable(v, ip) for k, v in sorted(value.items())
                if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v, ip) for v in value]
    return value.replace(ip, "<ip>") if isinstance(value, str) else value


class Vm:
    """A VM's ADS stream: its node as pilot-agent sends it, and its health reports."""

    def __init__(self, address: str, ip: str) -> None:
        metadata = struct_pb2.Struct()
        metadata.update({"NAMESPACE": NAMESPACE, "AUTO_REGISTER_GROUP": GROUP, "INSTANCE_IPS": ip, "NETWORK": "vm-net",
                         "LABELS": {"version": "v1", "istio-locality": "eu.a"}, "SERVICE_ACCOUNT": "db",
                         "CLUSTER_ID": "Kubernetes", "ISTIO_VERSION": "1.31.0",
                         "PROXY_CONFIG": {"readinessProbe": {"tcpSocket": {"port": 5432}, "periodSeconds": 2}}})
        self.node = base_pb2.Node(id=f"sidecar~{ip}~db-vm.{NAMESPACE}~{NAMESPACE}.svc.cluster.local",
                                  metadata=metadata, locality=base_pb2.Locality(region="eu", zone="a"))
        self.requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()
        self.channel = grpc.aio.insecure_channel(address)
        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel).StreamAggregatedResources(self._stream())
        self.requests.put_nowait(discovery_pb2.DiscoveryRequest(type_url=CLUSTER, node=self.node))
        self.reader = asyncio.create_task(self._read())

    async def _stream(self) -> Any:
        while (request := await self.requests.get()) is not None:
            yield request

    async def _read(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for _ in self.call:
                pass

    def health(self, message: str = "") -> None:
        request = discovery_pb2.DiscoveryRequest(type_url=HEALTH_INFO)
        if message:
            request.error_detail.code = 13
            request.error_detail.message = message
        self.requests.put_nowait(request)

    async def close(self) -> None:
        self.requests.put_nowait(None)
        self.call.cancel()
        self.reader.cancel()
        await self.channel.close()


async def compare(kubeconfig: Path, sides: dict[str, tuple[str, str]]) -> bool:
    """Each step on both sides, then both entries printed; True if they were the same every time."""
    api = await api_client(kubeconfig)
    custom = client.CustomObjectsApi(api)

    async def entry(ip: str) -> Any:
        listed = await custom.list_namespaced_custom_object("networking.istio.io", "v1", NAMESPACE, "workloadentries")
        found = [e for e in listed["items"] if e["spec"].get("address") == ip]
        return _stable(found[0], ip) if found else None

    same = True
    vms = {side: Vm(address, ip) for side, (address, ip) in sides.items()}
    steps = [("connected", None), ("healthy", ""), ("unhealthy", "dial tcp: connection refused"), ("left", None)]
    try:
        for step, message in steps:
            for vm in vms.values():
                if step == "left":
                    await vm.close()
                elif message is not None:
                    vm.health(message)
            await asyncio.sleep(1.0 if step != "left" else 5.0)  # past the 2 s grace period
            entries = {side: await entry(ip) for side, (_, ip) in sides.items()}
            alike = len({json.dumps(e, sort_keys=True) for e in entries.values()}) == 1
            same &= alike
            print(f"--- {step}: {'same' if alike else 'DIFFERENT'}")
            for side, found in entries.items():
                print(f"  {side}: {json.dumps(found, sort_keys=True)}")
    finally:
        for vm in vms.values():
            with contextlib.suppress(Exception):
                await vm.close()
        await api.close()
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_reference_argument(parser)
    args = parser.parse_args()
    binary = reference_binary(parser, args)
    os.environ.update(ISTIO_WORKLOAD_ENTRY_VALIDATE_IDENTITY="false", PILOT_WORKLOAD_ENTRY_GRACE_PERIOD="2s")
    with tempfile.TemporaryDirectory(prefix="wg-compare-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        (workdir / "cluster").mkdir()
        cluster = Cluster(workdir / "cluster", service_cidr=SERVICE_CIDR)
        stack.callback(cluster.stop)
        cluster.start()
        asyncio.run(load_mesh(cluster.kubeconfig, MESH))
        reference, reference_addr, _ = start_reference(binary, cluster.kubeconfig, workdir)
        stack.callback(stop_group, reference, 10)
        ours = Server(["--kubeconfig", str(cluster.kubeconfig)], workdir, None, None)
        stack.callback(ours.stop)
        time.sleep(2)
        same = asyncio.run(compare(cluster.kubeconfig, {"Istio": (reference_addr, "10.9.0.1"),
                                                        "ours": (ours.xds_addr, "10.9.0.2")}))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()

"""In-cluster analysis (PILOT_ENABLE_ANALYSIS) on a real API server: the elected istiod writes an
Istio object's `status.validationMessages` and `observedGeneration` as istiod does, clears them
when the problem is fixed, follows spec changes; a replica that does not hold the lock writes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from e2e.harness import Cluster
from e2e.istio_crds import create_istio_object, install_crds
from e2e.kube_objects import another_replica_leading, ensure_namespace
from istiod.status.analysis import ELECTION
from e2e.test_rbac import istiod_kubeconfig
from tests.peers import Istiod, Process, eventually, istio_binary

NS = "status-demo"
FAST = ("--leader-lease-duration", "2s", "--leader-renew-deadline", "1.5s", "--leader-retry-period", "0.25s")


def _vs(gateways: list[str]) -> dict[str, Any]:
    # Its host is no other test's: some analyzers compare destination hosts across namespaces as written.
    return {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
            "metadata": {"name": "reviews", "namespace": NS},
            "spec": {"hosts": ["details"], "gateways": gateways,
                     "http": [{"route": [{"destination": {"host": "details"}}]}]}}


def _message(code: str, level: str) -> dict[str, Any]:
    return {"type": {"code": code}, "level": level,
            "documentationUrl": f"https://istio.io/v1.31/docs/reference/config/analysis/{code.lower()}/"}


async def test_validation_messages_in_status_written_by_the_leader_only(
        cluster: Cluster, kube: client.ApiClient, tmp_path: Path, processes: list[Process]) -> None:
    await install_crds(kube)
    await ensure_namespace(kube, NS)
    with contextlib.suppress(client.ApiException):  # 409: from an earlier run on this cluster
        await client.CoreV1Api(kube).create_namespaced_service(NS, {
            "metadata": {"name": "details"}, "spec": {"ports": [{"name": "http", "port": 9080}]}})
    custom = client.CustomObjectsApi(kube)
    status: dict[str, Any] = {}

    async def read() -> dict[str, Any]:
        body = await custom.get_namespaced_custom_object("networking.istio.io", "v1", NS, "virtualservices", "reviews")
        status.clear()
        status.update(body.get("status") or {})
        return body

    # Another replica holds the lock: istiod must write nothing while it does.
    async with another_replica_leading(kube, ELECTION):
        await create_istio_object(kube, _vs(["missing-gw"]))
        # With its own ServiceAccount's token under deploy/rbac; started off the event loop, so that
        # the lock holder keeps renewing meanwhile.
        kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
        istiod = await asyncio.to_thread(Istiod, tmp_path, "--kubeconfig", str(kubeconfig), "--enable-analysis", "true",
                                         "--analysis-interval", "1s", *FAST, ready_timeout=60)
        processes.append(istiod)
        await asyncio.sleep(4)  # several analysis intervals and lease renewals
        await read()
        assert status == {}

    # The lock is free: istiod takes it and writes the messages istioctl analyze gives for the object.
    problem = {"observedGeneration": "1",
               "validationMessages": [_message("IST0101", "ERROR"), _message("IST0132", "WARNING")]}

    async def shows(expected: dict[str, Any]) -> bool:
        await read()
        return status == expected

    try:
        await eventually(lambda: shows(problem), 20, "the problem in the status")
    except AssertionError:
        print(istiod.text())
        raise

    # The same codes and levels as istioctl analyze gives for the object on this cluster.
    done = await asyncio.to_thread(subprocess.run, [istio_binary("istioctl"), "analyze", "--kubeconfig",
                                                    str(cluster.kubeconfig), "-n", NS, "-o", "json"],
                                   capture_output=True, text=True, timeout=120)
    assert {(m["code"], m["level"].upper()) for m in json.loads(done.stdout)
            if m["origin"] == f"VirtualService {NS}/reviews"} == \
        {(m["type"]["code"], m["level"]) for m in problem["validationMessages"]}

    # Fixed: the messages go, the generation analyzed is the new one.
    body = await read()
    body["spec"]["gateways"] = ["mesh"]
    await custom.replace_namespaced_custom_object("networking.istio.io", "v1", NS, "virtualservices", "reviews", body)
    await eventually(lambda: shows({"observedGeneration": "2"}), 20, "the fixed object's status")

    # Broken again, another way: the status follows the spec.
    body = await read()
    body["spec"]["http"][0]["route"][0]["destination"]["subset"] = "v9"
    await custom.replace_namespaced_custom_object("networking.istio.io", "v1", NS, "virtualservices", "reviews", body)
    await eventually(lambda: shows({"observedGeneration": "3", "validationMessages": [_message("IST0101", "ERROR")]}),
                           20, "the new problem in the status")


"""`istiod analyze --kubeconfig` and Istio's `istioctl analyze --kubeconfig` on one real API server:
the same messages (the analyzers that need Services, Pods and Namespaces run only here)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e.harness import Cluster
from e2e.istio_crds import create_istio_object, install_crds
from istiod.model.config.kinds import BY_KIND
from tests.peers import istio_binary

OBJECTS = Path(__file__).parent / "data" / "analyze-cluster.yaml"


async def _create(api: client.ApiClient, body: Any) -> None:
    core = client.CoreV1Api(api)
    namespace = body["metadata"].get("namespace", "")
    try:
        if body["kind"] in BY_KIND:
            await create_istio_object(api, body)
            if "status" in body:  # the status subresource: not taken on create
                group, _, version = body["apiVersion"].partition("/")
                await client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
                    group, version, namespace, BY_KIND[body["kind"]].plural, body["metadata"]["name"],
                    {"status": body["status"]}, _content_type="application/merge-patch+json")
        elif body["kind"] == "Namespace":
            await core.create_namespace(body)
        elif body["kind"] == "Service":
            await core.create_namespaced_service(namespace, body)
        elif body["kind"] == "Secret":
            await core.create_namespaced_secret(namespace, body)
        elif body["kind"] == "Deployment":
            await client.AppsV1Api(api).create_namespaced_deployment(namespace, body)
        else:
            await core.create_namespaced_pod(namespace, body)
    except ApiException as error:
        if error.status != 409:
            raise


def _messages(output: str) -> set[tuple[str, ...]]:
    """Every field of each message."""
    return {tuple(sorted(m.items())) for m in json.loads(output)}


def _analyze(command: list[str]) -> set[tuple[str, ...]]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return _messages(done.stdout)


async def test_same_messages_as_istioctl_on_a_cluster(cluster: Cluster, kube: client.ApiClient) -> None:
    await install_crds(kube)
    for body in yaml.safe_load_all(OBJECTS.read_text()):
        await _create(kube, body)
    kubeconfig = str(cluster.kubeconfig)
    expected = await asyncio.to_thread(
        _analyze, [istio_binary("istioctl"), "analyze", "--kubeconfig", kubeconfig, "-A", "-o", "json"])
    ours = await asyncio.to_thread(
        _analyze, [sys.executable, "-m", "istiod", "analyze", "--kubeconfig", kubeconfig, "-A", "-o", "json"])
    print("istioctl:", *sorted(expected), sep="\n  ")
    assert ours == expected
    codes = {dict(m)["code"] for m in expected}
    assert {"IST0101", "IST0102", "IST0103", "IST0107", "IST0108", "IST0135", "IST0109", "IST0110", "IST0111", "IST0112", "IST0118", "IST0123", "IST0125",
            "IST0116", "IST0127", "IST0137", "IST0140", "IST0144", "IST0145", "IST0149", "IST0150", "IST0161", "IST0162", "IST0166", "IST0171",
            "IST0173", "IST0174"} <= codes

    # Only the selected namespace, as istioctl's default.
    shop = await asyncio.to_thread(
        _analyze, [sys.executable, "-m", "istiod", "analyze", "--kubeconfig", kubeconfig, "-n", "shop", "-o", "json"])
    origins = {m: dict(m)["origin"] for m in expected}
    assert shop == {m for m, o in origins.items() if o.split(" ")[1].startswith("shop/") or o == "Namespace shop"}

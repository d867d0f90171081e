"""Istio's CRDs on a real kube-apiserver: one object of each kind, kubectl's columns, and istiod
reading them through its informers (a bad one logged and skipped, the last good one kept)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client

from e2e.harness import Cluster
from e2e.istio_crds import create_istio_object, install_crds
from e2e.kube_objects import ensure_namespace
from istiod.model.config.kinds import CONFIG_KINDS
from tests.peers import Istiod, wait_until

VALID = Path(__file__).parent.parent / "tests" / "data" / "istio" / "valid.yaml"


async def table(api: client.ApiClient, path: str) -> dict:
    """What `kubectl get` prints: the server-side Table with the CRD's printer columns."""
    response = await api.call_api(path, "GET", header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
                                  auth_settings=["BearerToken"], _preload_content=False)
    try:
        return json.loads(await response.read())
    finally:
        response.release()


async def test_crds_objects_columns_and_informers(kube: client.ApiClient, start_istiod_kube: Callable[..., Istiod]) -> None:
    await install_crds(kube)
    objects = list(yaml.safe_load_all(VALID.read_text()))
    for namespace in sorted({o["metadata"]["namespace"] for o in objects}):
        await ensure_namespace(kube, namespace)
    for body in objects:
        await create_istio_object(kube, body)

    vs = await table(kube, "/apis/networking.istio.io/v1/namespaces/demo/virtualservices")
    print("kubectl get vs:", [c["name"] for c in vs["columnDefinitions"]], vs["rows"][0]["cells"])
    assert [c["name"] for c in vs["columnDefinitions"]][1:] == ["Gateways", "Hosts", "Age"]
    assert vs["rows"][0]["cells"][:3] == ["reviews", '["mesh","ingress","istio-system/shared-gw"]', '["reviews"]']
    pa = await table(kube, "/apis/security.istio.io/v1/namespaces/demo/peerauthentications")
    assert pa["rows"][0]["cells"][:2] == ["reviews", "UNSET"]
    # The short names and the storage version: v1alpha3 reads what v1 wrote.
    await client.CustomObjectsApi(kube).get_namespaced_custom_object(
        "networking.istio.io", "v1alpha3", "demo", "virtualservices", "reviews")

    istiod = start_istiod_kube()

    # Only this test's objects: others of the session may leave theirs in the cluster.
    mine = {(o["kind"], o["metadata"]["namespace"], o["metadata"]["name"]) for o in objects}

    def served() -> list[dict[str, Any]]:
        status, listed = istiod.get("/debug/configz")
        return [o for o in listed if (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) in mine
                ] if status == 200 else []

    def kinds() -> set[str]:
        return {o["kind"] for o in served()}

    wait_until(lambda: {k.kind for k in CONFIG_KINDS} <= kinds(), 10, "every Istio kind read by the informers")

    # The API server takes a bad weight (no webhook here): istiod refuses it and keeps the good one.
    custom = client.CustomObjectsApi(kube)
    await custom.patch_namespaced_custom_object(
        "networking.istio.io", "v1", "demo", "virtualservices", "reviews",
        [{"op": "replace", "path": "/spec/http/1/route/0/weight", "value": -3}])
    wait_until(lambda: "spec.http[1].route[0]: weight: -3 < 0" in istiod.log(), 10, "the refusal in istiod's log")
    reviews = next(o for o in served() if o["kind"] == "VirtualService" and o["metadata"]["name"] == "reviews"
                   and o["metadata"]["namespace"] == "demo")
    assert "weight" not in reviews["spec"]["http"][1]["route"][0]  # the last good version
    for body in objects:
        kind = next(k for k in CONFIG_KINDS if k.kind == body["kind"])
        await custom.delete_namespaced_custom_object(kind.group, kind.versions[-1], body["metadata"]["namespace"], kind.plural,
                                                     body["metadata"]["name"])
    wait_until(lambda: not ({k.kind for k in CONFIG_KINDS} & kinds()), 10, "deletions followed")


async def test_analyze_a_cluster(kube: client.ApiClient, cluster: Cluster) -> None:
    await install_crds(kube)
    await ensure_namespace(kube, "e2e-analyze")
    await create_istio_object(kube, {
        "apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
        "metadata": {"name": "lost", "namespace": "e2e-analyze"},
        "spec": {"hosts": ["lost"], "http": [{"route": [{"destination": {"host": "nowhere"}}]}]}})
    result = subprocess.run([sys.executable, "-m", "istiod", "analyze", "--kubeconfig", str(cluster.kubeconfig),
                             "-n", "e2e-analyze"], capture_output=True, text=True, timeout=60)
    print(result.stdout)
    assert result.returncode == 79, result.stderr  # istioctl's exit code when a message is an Error
    assert any(line.startswith("Error [IST0101] (VirtualService e2e-analyze/lost) Referenced host not found:")
               for line in result.stdout.splitlines()), result.stdout

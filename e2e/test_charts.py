"""The real kube-apiserver accepts every object the charts render: a server-side apply with
dryRun=All and strict field validation (an unknown or misplaced field is an error), so nothing is
stored and the session's other tests see no change."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e.harness import ApiServer, Cluster
from e2e.kube_objects import ISTIO_NAMESPACE, ensure_namespace
from tests.peers import ROOT, eventually
from tests.test_charts import CHARTS, HELM, render
from tests.test_operator import generate

QUERY = urllib.parse.urlencode({"dryRun": "All", "fieldManager": "istiod-charts-test", "force": "true",
                                "fieldValidation": "Strict"})


def request(server: ApiServer, method: str, path: str, body: Any = None) -> Any:
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/apply-patch+yaml"  # JSON is YAML
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{server.url}{path}", data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, context=server.ssl_context(), timeout=30) as reply:
        return json.load(reply)


def dry_run_apply(server: ApiServer, objects: list[dict[str, Any]]) -> list[str]:
    """Each object server-side applied with dryRun=All; the refusals, as the API server words them."""
    resources: dict[str, dict[str, tuple[str, bool]]] = {}  # apiVersion -> kind -> (plural, namespaced)
    refusals = []
    for obj in objects:
        version = obj["apiVersion"]
        prefix = f"/api/{version}" if "/" not in version else f"/apis/{version}"
        if version not in resources:
            listed = request(server, "GET", prefix)["resources"]
            resources[version] = {r["kind"]: (r["name"], r["namespaced"]) for r in listed if "/" not in r["name"]}
        plural, namespaced = resources[version][obj["kind"]]
        meta = obj["metadata"]
        scope = f"/namespaces/{meta['namespace']}" if namespaced else ""
        try:
            request(server, "PATCH", f"{prefix}{scope}/{plural}/{meta['name']}?{QUERY}", obj)
        except urllib.error.HTTPError as error:
            refusals.append(f"{obj['kind']}/{meta['name']}: {error.code} {error.read().decode()}")
    return refusals


async def test_charts_apply_server_side(cluster: Cluster, kube: client.ApiClient) -> None:
    await ensure_namespace(kube, ISTIO_NAMESPACE)
    objects = render(CHARTS / "base") + render(CHARTS / "istiod") + render(CHARTS / "istiod", "--set", "caMode=plugged,autoscale.enabled=false")
    assert len(objects) > 12
    assert dry_run_apply(cluster.apiserver, objects) == []
    try:
        request(cluster.apiserver, "GET", f"/apis/apps/v1/namespaces/{ISTIO_NAMESPACE}/deployments/istiod")
        raise AssertionError("a dry run stored the Deployment")
    except urllib.error.HTTPError as error:
        assert error.code == 404


async def test_istio_operator_render_applies_server_side(cluster: Cluster, kube: client.ApiClient) -> None:
    done = generate("-f", str(ROOT / "tests" / "data" / "operator" / "k8s.iop.yaml"))
    assert done.returncode == 0, done.stderr
    objects = [o for o in yaml.safe_load_all(done.stdout) if o]
    await ensure_namespace(kube, "mesh-prod")
    assert dry_run_apply(cluster.apiserver, objects) == []


async def test_a_wrong_field_is_refused(cluster: Cluster, kube: client.ApiClient) -> None:
    """The check itself: the API server does refuse a misplaced field in a dry run."""
    await ensure_namespace(kube, ISTIO_NAMESPACE)
    [service] = [o for o in render(CHARTS / "istiod") if o["kind"] == "Service"]
    service["spec"]["ports"][0]["targetPorts"] = 15010
    [refusal] = dry_run_apply(cluster.apiserver, [service])
    assert refusal.startswith("Service/istiod: ") and "targetPorts: field not declared in schema" in refusal


async def test_install_applies_and_waits_for_the_rollout(cluster: Cluster, kube: client.ApiClient) -> None:
    """`istiod install` for real (the istiod chart in its own namespace), then everything removed: with no
    controller-manager here, the test writes the Deployment's status as its controller would."""
    namespace = "e2e-install"
    command = [sys.executable, "-m", "istiod", "install", "--helm", str(HELM), "--kubeconfig", str(cluster.kubeconfig),
               "--set", "components.base.enabled=false", "--set", f"namespace={namespace}",
               "--set", "components.pilot.k8s.replicaCount=2"]
    apps = client.AppsV1Api(kube)
    installing = subprocess.Popen([*command, "--readiness-timeout", "60s"], cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deployment = await eventually(lambda: _read(apps.read_namespaced_deployment("istiod", namespace)), 30,
                                      "the Deployment, applied")
        assert installing.poll() is None  # waiting for the rollout
        await apps.patch_namespaced_deployment_status("istiod", namespace, {"status": {
            "observedGeneration": deployment.metadata.generation, "replicas": 2, "updatedReplicas": 2,
            "readyReplicas": 2, "availableReplicas": 2}})
        _, stderr = installing.communicate(timeout=30)
        assert installing.returncode == 0, stderr
        assert "istiod is ready in e2e-install" in stderr
        config = await client.CoreV1Api(kube).read_namespaced_config_map("istio", namespace)
        assert config.metadata.managed_fields[0].manager == "istiod-install"

        # Again with a change, the rollout never finishing: applied, then one line, exit 1.
        await apps.patch_namespaced_deployment_status("istiod", namespace, {"status": {"readyReplicas": 0, "availableReplicas": 0}})
        done = subprocess.run([*command, "--readiness-timeout", "2s", "--set", "components.pilot.k8s.replicaCount=3"],
                              cwd=ROOT, text=True, capture_output=True, timeout=60)
        assert done.returncode == 1
        assert done.stderr.splitlines()[-1] == f"istiod install: Deployment {namespace}/istiod not ready after 2s (ready 0 of 3)"
        assert (await apps.read_namespaced_deployment("istiod", namespace)).spec.replicas == 3

        # An object the API server refuses: named, with the server's reason.
        done = subprocess.run([*command, "--readiness-timeout", "2s", "--set", "components.pilot.k8s.resources.requests.cpu=lots"],
                              cwd=ROOT, text=True, capture_output=True, timeout=60)
        assert done.returncode == 1
        refusal = done.stderr.splitlines()[-1]
        assert refusal.startswith(f"istiod install: Deployment {namespace}/istiod: API error 500 Internal Server Error: ")
        assert "quantities must match the regular expression" in refusal, refusal
    finally:
        installing.kill()
        installing.communicate()
        objects = [o for o in yaml.safe_load_all(generate("--set", "components.base.enabled=false", "--set",
                                                          f"namespace={namespace}").stdout) if o]
        for obj in objects:  # the cluster-scoped ones too (the webhook would refuse Istio objects)
            meta = obj["metadata"]
            version = obj["apiVersion"]
            prefix = f"/api/{version}" if "/" not in version else f"/apis/{version}"
            plural = {r["kind"]: r["name"] for r in request(cluster.apiserver, "GET", prefix)["resources"]}[obj["kind"]]
            scope = f"/namespaces/{meta['namespace']}" if "namespace" in meta else ""
            try:
                request(cluster.apiserver, "DELETE", f"{prefix}{scope}/{plural}/{meta['name']}")
            except urllib.error.HTTPError as error:
                assert error.code == 404


async def _read(reading: Any) -> Any:
    try:
        return await reading
    except ApiException as error:
        if error.status == 404:
            return None
        raise

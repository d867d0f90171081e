"""The real kube-apiserver accepts every object the charts render: a server-side apply with
dryRun=All and strict field validation (an unknown or misplaced field is an error), so nothing is
stored and the session's other tests see no change."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import yaml
from kubernetes_asyncio import client

from e2e.harness import ApiServer, Cluster
from e2e.kube_objects import ISTIO_NAMESPACE, ensure_namespace
from tests.peers import ROOT
from tests.test_charts import CHARTS, render
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

"""The real kube-apiserver accepts every object the charts render: a server-side apply with
dryRun=All and strict field validation (an unknown or misplaced field is an error), so nothing is
stored and the session's other tests see no change."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e.harness import ApiServer, Cluster
from e2e.kube_objects import ISTIO_NAMESPACE, ensure_namespace
from e2e.test_ca import (LEADER_FLAGS, ensure_account, forget_the_root, holder, leads, published_root, secret_root,
                         token_for)
from e2e.test_rbac import token_kubeconfig
from istiod.ca.pki import load_certs, new_key, uri_sans
from istiod.revision import injector_name, validator_name
from tests.peers import ROOT, Istiod, Process, eventually
from tests.pki import csr_pem
from tests.secure_port import CaEndpoint
from tests.test_ca_service import create
from tests.test_charts import CHARTS, HELM, render
from tests.test_operator import generate

LIVE = "e2e-chart-live"  # a namespace that gets istiod's root ConfigMap
VALIDATOR, INJECTOR = validator_name("default", ISTIO_NAMESPACE), injector_name("default")
KINDS = {VALIDATOR: "ValidatingWebhookConfiguration", INJECTOR: "MutatingWebhookConfiguration"}
QUERY = {"fieldManager": "istiod-charts-test", "force": "true", "fieldValidation": "Strict"}


def request(server: ApiServer, method: str, path: str, body: Any = None) -> Any:
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/apply-patch+yaml"  # JSON is YAML
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{server.url}{path}", data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, context=server.ssl_context(), timeout=30) as reply:
        return json.load(reply)


def object_path(server: ApiServer, obj: dict[str, Any]) -> str:
    version = obj["apiVersion"]
    prefix = f"/api/{version}" if "/" not in version else f"/apis/{version}"
    [(plural, namespaced)] = [(r["name"], r["namespaced"]) for r in request(server, "GET", prefix)["resources"]
                              if r["kind"] == obj["kind"] and "/" not in r["name"]]
    meta = obj["metadata"]
    scope = f"/namespaces/{meta['namespace']}" if namespaced else ""
    return f"{prefix}{scope}/{plural}/{meta['name']}"


def dry_run_apply(server: ApiServer, objects: list[dict[str, Any]], dry_run: bool = True) -> list[str]:
    """Each object server-side applied (with dryRun=All unless told); the refusals, as the API server words them."""
    query = urllib.parse.urlencode({**QUERY, "dryRun": "All"} if dry_run else QUERY)
    refusals = []
    for obj in objects:
        try:
            request(server, "PATCH", f"{object_path(server, obj)}?{query}", obj)
        except urllib.error.HTTPError as error:
            refusals.append(f"{obj['kind']}/{obj['metadata']['name']}: {error.code} {error.read().decode()}")
    return refusals


def delete(server: ApiServer, objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        try:
            request(server, "DELETE", object_path(server, obj))
        except urllib.error.HTTPError as error:
            assert error.code == 404


async def test_charts_apply_server_side(cluster: Cluster, kube: client.ApiClient) -> None:
    await ensure_namespace(kube, ISTIO_NAMESPACE)
    objects = render(CHARTS / "base") + render(CHARTS / "istiod") + render(CHARTS / "istiod", "--set", "caMode=plugged,autoscale.enabled=false")
    objects += render(CHARTS / "istiod", "--set", "ambient=true") + render(CHARTS / "cni") + render(CHARTS / "ztunnel")
    objects += render(CHARTS / "istiod", "--set", "revision=py,revisionTags={prod,default}")  # a canary beside
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


async def test_ambient_profile_render_applies_server_side(cluster: Cluster, kube: client.ApiClient) -> None:
    done = generate("--set", "profile=ambient", "--set", "namespace=mesh-ambient")
    assert done.returncode == 0, done.stderr
    objects = [o for o in yaml.safe_load_all(done.stdout) if o]
    assert {("DaemonSet", "ztunnel"), ("DaemonSet", "istio-cni-node")} <= {(o["kind"], o["metadata"]["name"]) for o in objects}
    await ensure_namespace(kube, "mesh-ambient")
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
        delete(cluster.apiserver, objects)  # the cluster-scoped ones too (the webhook would refuse Istio objects)


async def _read(reading: Any) -> Any:
    try:
        return await reading
    except ApiException as error:
        if error.status == 404:
            return None
        raise


async def test_istiod_runs_with_only_the_charts_rbac(
    cluster: Cluster, kube: client.ApiClient, tmp_path: Path, processes: list[Process]
) -> None:
    """Both charts applied for real in istio-system; istiod as the chart's ServiceAccount (a TokenRequest
    token, nothing else granted): it syncs, creates the root Secret, writes root ConfigMaps, fills both
    webhooks' caBundle and takes the leader-election lock, and is never refused."""
    core, admission = client.CoreV1Api(kube), client.AdmissionregistrationV1Api(kube)
    objects = render(CHARTS / "base") + render(CHARTS / "istiod")
    # The RBAC and CRDs stay (the same as deploy/rbac and crds/, which other tests use); the rest goes.
    removed = [o for o in objects if o["kind"] not in {"CustomResourceDefinition", "ServiceAccount", "ClusterRole",
                                                        "ClusterRoleBinding", "Role", "RoleBinding"}]
    await ensure_namespace(kube, LIVE)
    await forget_the_root(kube)  # so that istiod creates the Secret and takes the lock
    try:
        assert dry_run_apply(cluster.apiserver, objects, dry_run=False) == []
        for name in (VALIDATOR, INJECTOR):  # the charts' caBundle "" is not stored: a JSON patch must not need it
            assert "caBundle" not in request(cluster.apiserver, "GET", object_path(
                cluster.apiserver, {"apiVersion": "admissionregistration.k8s.io/v1", "kind": KINDS[name],
                                    "metadata": {"name": name}}))["webhooks"][0]["clientConfig"]
        token = (await core.create_namespaced_service_account_token(
            "istiod", ISTIO_NAMESPACE, {"spec": {"expirationSeconds": 3600}})).status.token
        kubeconfig = token_kubeconfig(cluster, token, tmp_path / "istiod.kubeconfig")
        istiod = Istiod(tmp_path, "--kubeconfig", str(kubeconfig), *LEADER_FLAGS, ready_timeout=60,
                        env={"POD_NAME": "istiod-chart"})
        processes.append(istiod)  # ready: every informer has synced

        root = await published_root(kube, LIVE)
        assert root == await secret_root(kube)
        bundle = base64.b64encode(root.encode()).decode()

        async def patched() -> bool:
            configs = (await admission.read_validating_webhook_configuration(VALIDATOR),
                       await admission.read_mutating_webhook_configuration(INJECTOR))
            return all(hook.client_config.ca_bundle == bundle for config in configs for hook in config.webhooks)

        await eventually(patched, 10, "istiod to set both webhook configurations' caBundle")
        await ensure_account(kube, LIVE, "web")  # the CA reviews a workload's token
        chain = (await create(CaEndpoint(istiod.secure_address, root.encode()), csr_pem(new_key()),
                              token=await token_for(kube, LIVE, "web"))).cert_chain
        assert uri_sans(load_certs(chain[0].encode(), "leaf")[0]) == [f"spiffe://cluster.local/ns/{LIVE}/sa/web"]
        assert (await holder(kube))["holderIdentity"] == "istiod-chart"
        assert leads(istiod)
        log = istiod.text()
        assert "Forbidden" not in log and token not in log
        print("istiod as the chart's ServiceAccount:", *[line for line in log.splitlines() if "caBundle" in line], sep="\n")
    finally:
        delete(cluster.apiserver, removed)  # the webhooks would refuse other tests' Istio objects and pods

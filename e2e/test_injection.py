"""The real kube-apiserver, given istiod's MutatingWebhookConfiguration, calls /inject when a Pod
is created and stores the patched Pod; pods outside the selectors are untouched; a webhook that is
down makes creation follow failurePolicy (Fail refuses, Ignore stores the pod as sent). istiod runs
as its ServiceAccount under deploy/rbac, reads the injector ConfigMap and sets both caBundles."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e.harness import Cluster
from e2e.istio_crds import create_istio_object, install_crds
from e2e.kube_objects import ISTIO_NAMESPACE, ensure_namespace
from e2e.test_rbac import istiod_kubeconfig
from e2e.test_webhook import istiod_patching
from tests.peers import ROOT, Process, eventually, free_port

INJECTED, PLAIN, OBJECT, DOWN = "e2e-inject-on", "e2e-inject-off", "e2e-inject-object", "e2e-inject-down"


def manifests() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "webhooks" / "injection.yaml").read_text()))
    return (next(d for d in docs if d["kind"] == "MutatingWebhookConfiguration"),
            next(d for d in docs if d["kind"] == "ConfigMap"))


def by_url(config: dict[str, Any], port: int) -> dict[str, Any]:
    """No Service routes to a process in this cluster: the same webhooks, addressed by URL."""
    config = copy.deepcopy(config)
    for hook in config["webhooks"]:
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}/inject", "caBundle": hook["clientConfig"]["caBundle"]}
    return config


def app_pod(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    # The harness's API server runs without the ServiceAccount admission plugin, which would set
    # the account; without one the API refuses the injected projected token.
    return {"metadata": {"name": name, "labels": {"app": "echo", **(labels or {})}},
            "spec": {"serviceAccountName": "default", "containers": [{"name": "echo", "image": "echo:1"}]}}


def summary(pod: client.V1Pod) -> str:
    return json.dumps({"containers": [c.name for c in pod.spec.containers],
                       "initContainers": [c.name for c in pod.spec.init_containers or []],
                       "volumes": [v.name for v in pod.spec.volumes or []],
                       "labels": pod.metadata.labels,
                       "status": (pod.metadata.annotations or {}).get("sidecar.istio.io/status")})


async def test_api_server_stores_injected_pods(
    cluster: Cluster, kube: client.ApiClient, tmp_path: Path, processes: list[Process]
) -> None:
    core, admission = client.CoreV1Api(kube), client.AdmissionregistrationV1Api(kube)
    webhooks, configmap = manifests()
    await ensure_namespace(kube, INJECTED, {"istio-injection": "enabled"})
    await ensure_namespace(kube, PLAIN)
    await ensure_namespace(kube, OBJECT)
    kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    await core.create_namespaced_config_map(ISTIO_NAMESPACE, configmap)
    port = free_port()
    await admission.create_mutating_webhook_configuration(by_url(webhooks, port))
    try:
        istiod = await istiod_patching(tmp_path, kubeconfig, port, processes, functools.partial(
            admission.read_mutating_webhook_configuration, webhooks["metadata"]["name"]))
        # The ConfigMap is read by a watch: until it is, /inject fails and failurePolicy Fail refuses.
        async def created() -> client.V1Pod | None:
            try:
                return await core.create_namespaced_pod(INJECTED, app_pod("echo"))
            except ApiException as error:
                print("not yet:", json.loads(error.body)["message"])
                return None

        await eventually(created, 10, "a pod to be admitted by the injector")
        stored = await core.read_namespaced_pod("echo", INJECTED)
        print("stored in the labelled namespace:", summary(stored))
        assert [c.name for c in stored.spec.containers] == ["echo", "istio-proxy"]
        assert [c.name for c in stored.spec.init_containers] == ["istio-init"]
        assert stored.spec.init_containers[0].args[:2] == ["agent", "iptables"]
        assert stored.metadata.labels["security.istio.io/tlsMode"] == "istio"
        assert json.loads(stored.metadata.annotations["sidecar.istio.io/status"])["containers"] == ["istio-proxy"]
        token = next(v for v in stored.spec.volumes if v.name == "istio-token")
        assert token.projected.sources[0].service_account_token.audience == "istio-ca"

        opted_out = await core.create_namespaced_pod(INJECTED, app_pod("opted-out", {"sidecar.istio.io/inject": "false"}))
        plain = await core.create_namespaced_pod(PLAIN, app_pod("echo"))
        for pod in (opted_out, plain):
            print("stored untouched:", pod.metadata.namespace, summary(pod))
            assert [c.name for c in pod.spec.containers] == ["echo"] and not pod.spec.init_containers
            assert "security.istio.io/tlsMode" not in pod.metadata.labels

        by_label = await core.create_namespaced_pod(OBJECT, app_pod("echo", {"sidecar.istio.io/inject": "true"}))
        print("stored, opted in by its label:", summary(by_label))
        assert [c.name for c in by_label.spec.containers] == ["echo", "istio-proxy"]
        assert "Forbidden" not in istiod.text()
    finally:
        # With failurePolicy Fail and istiod gone, the webhook would refuse every later pod there.
        await admission.delete_mutating_webhook_configuration(webhooks["metadata"]["name"])
        await core.delete_namespaced_config_map(configmap["metadata"]["name"], ISTIO_NAMESPACE)


@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
async def test_webhook_down_follows_failure_policy(kube: client.ApiClient, policy: str) -> None:
    core, admission = client.CoreV1Api(kube), client.AdmissionregistrationV1Api(kube)
    namespace = f"{DOWN}-{policy.lower()}"
    await ensure_namespace(kube, namespace, {"istio-injection": "enabled"})
    webhooks, _ = manifests()
    config = by_url(webhooks, free_port())  # nothing listens there
    config["metadata"]["name"] = f"istio-sidecar-injector-{namespace}"
    config["webhooks"] = [h for h in config["webhooks"] if h["name"] == "namespace.sidecar-injector.istio.io"]
    # Only this test's namespace, so that parallel tests' pods never meet this webhook.
    config["webhooks"][0]["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    config["webhooks"][0]["failurePolicy"] = policy
    await admission.create_mutating_webhook_configuration(config)
    try:
        if policy == "Fail":
            with pytest.raises(ApiException) as refused:
                await core.create_namespaced_pod(namespace, app_pod("echo"))
            message = json.loads(refused.value.body)["message"]
            print("kube-apiserver said:", message)
            assert refused.value.status == 500
            assert 'failed calling webhook "namespace.sidecar-injector.istio.io"' in message
            with pytest.raises(ApiException):
                await core.read_namespaced_pod("echo", namespace)
        else:
            pod = await core.create_namespaced_pod(namespace, app_pod("echo"))
            print("stored without a sidecar:", summary(pod))
            assert [c.name for c in pod.spec.containers] == ["echo"]
    finally:
        await admission.delete_mutating_webhook_configuration(config["metadata"]["name"])


async def test_api_server_stores_pods_in_istios_layout(
    cluster: Cluster, kube: client.ApiClient, tmp_path: Path, processes: list[Process]
) -> None:
    """The injector config's `layout: istio` (the chart's sidecarLayout istio): the API server takes
    Istio's own layout, native sidecar included, and the app's probe rewritten to the agent."""
    core, admission = client.CoreV1Api(kube), client.AdmissionregistrationV1Api(kube)
    namespace = "e2e-inject-istio-layout"
    webhooks, configmap = manifests()
    configmap = copy.deepcopy(configmap)
    configmap["data"] = {"config": "policy: enabled\ndefaultTemplates: [sidecar]\nlayout: istio\n",
                         "values": json.dumps({"global": {"proxy": {"image": "docker.io/istio/proxyv2:1.28.0"},
                                                          "proxy_init": {"image": "docker.io/istio/proxyv2:1.28.0"},
                                                          "nativeSidecar": True}})}
    webhooks = by_url(webhooks, free_port())
    port = int(webhooks["webhooks"][0]["clientConfig"]["url"].split(":")[2].split("/")[0])
    webhooks["webhooks"] = webhooks["webhooks"][:1]  # istiod fills the caBundle of this name only
    webhooks["webhooks"][0]["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    await ensure_namespace(kube, namespace)
    kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    await core.create_namespaced_config_map(ISTIO_NAMESPACE, configmap)
    await admission.create_mutating_webhook_configuration(webhooks)
    try:
        await istiod_patching(tmp_path, kubeconfig, port, processes, functools.partial(
            admission.read_mutating_webhook_configuration, webhooks["metadata"]["name"]))
        pod = app_pod("probed")
        pod["spec"]["containers"][0]["readinessProbe"] = {"httpGet": {"path": "/ready", "port": 8080}}

        async def created() -> client.V1Pod | None:
            try:
                return await core.create_namespaced_pod(namespace, pod)
            except ApiException as error:
                print("not yet:", json.loads(error.body)["message"])
                return None

        await eventually(created, 10, "a pod to be admitted by the injector")
        stored = await core.read_namespaced_pod("probed", namespace)
        print("stored in Istio's layout:", summary(stored))
        assert [c.name for c in stored.spec.init_containers] == ["istio-init", "istio-proxy"]
        init, proxy = stored.spec.init_containers
        assert init.args[0] == "istio-iptables" and init.image == "docker.io/istio/proxyv2:1.28.0"
        assert proxy.restart_policy == "Always" and proxy.args[:2] == ["proxy", "sidecar"]
        assert [c.name for c in stored.spec.containers] == ["echo"]
        probe = stored.spec.containers[0].readiness_probe.http_get
        assert (probe.path, probe.port) == ("/app-health/echo/readyz", 15020)
        env = {e.name: e.value for e in proxy.env}
        # The webhook sees the pod with the API server's defaults (scheme, timeout), as Istio's does.
        assert json.loads(env["ISTIO_KUBE_APP_PROBERS"]) == {"/app-health/echo/readyz": {
            "httpGet": {"path": "/ready", "port": 8080, "scheme": "HTTP"}, "timeoutSeconds": 1}}
    finally:
        await admission.delete_mutating_webhook_configuration(webhooks["metadata"]["name"])
        await core.delete_namespaced_config_map(configmap["metadata"]["name"], ISTIO_NAMESPACE)


async def test_proxy_config_objects_reach_injected_pods(
    cluster: Cluster, kube: client.ApiClient, tmp_path: Path, processes: list[Process]
) -> None:
    """A ProxyConfig created through the API server, read by istiod's informer: the pods its selector
    matches are stored with its concurrency in PROXY_CONFIG and its environmentVariables as env."""
    core, admission = client.CoreV1Api(kube), client.AdmissionregistrationV1Api(kube)
    namespace = "e2e-inject-proxyconfig"
    webhooks, configmap = manifests()
    webhooks = by_url(webhooks, free_port())
    port = int(webhooks["webhooks"][0]["clientConfig"]["url"].split(":")[2].split("/")[0])
    webhooks["webhooks"] = webhooks["webhooks"][:1]  # istiod fills the caBundle of this name only
    webhooks["webhooks"][0]["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    await install_crds(kube)
    await ensure_namespace(kube, namespace)
    await create_istio_object(kube, {
        "apiVersion": "networking.istio.io/v1beta1", "kind": "ProxyConfig",
        "metadata": {"name": "echo", "namespace": namespace},
        "spec": {"selector": {"matchLabels": {"app": "echo"}}, "concurrency": 3,
                 "environmentVariables": {"ISTIO_META_TEAM": "blue"}}})
    kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    await core.create_namespaced_config_map(ISTIO_NAMESPACE, configmap)
    await admission.create_mutating_webhook_configuration(webhooks)
    try:
        await istiod_patching(tmp_path, kubeconfig, port, processes, functools.partial(
            admission.read_mutating_webhook_configuration, webhooks["metadata"]["name"]))
        attempt = 0

        async def created() -> dict[str, str] | None:
            """The injected proxy's env, once istiod has listed the ProxyConfig (an earlier pod is removed)."""
            nonlocal attempt
            attempt += 1
            try:
                pod = await core.create_namespaced_pod(namespace, app_pod(f"echo-{attempt}"))
            except ApiException as error:
                print("not yet:", json.loads(error.body)["message"])
                return None
            proxy = next(c for c in pod.spec.containers if c.name == "istio-proxy")
            env = {e.name: e.value for e in proxy.env or []}
            if "concurrency" in json.loads(env.get("PROXY_CONFIG") or "{}"):
                return env
            await core.delete_namespaced_pod(f"echo-{attempt}", namespace)
            return None

        env = await eventually(created, 20, "a pod injected with the ProxyConfig", interval=0.5)
        print("stored PROXY_CONFIG:", env["PROXY_CONFIG"])
        assert json.loads(env["PROXY_CONFIG"])["concurrency"] == 3 and env["ISTIO_META_TEAM"] == "blue"
    finally:
        await admission.delete_mutating_webhook_configuration(webhooks["metadata"]["name"])
        await core.delete_namespaced_config_map(configmap["metadata"]["name"], ISTIO_NAMESPACE)

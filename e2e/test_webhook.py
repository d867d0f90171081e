"""The real kube-apiserver asks istiod's validating webhook: a bad VirtualService is refused with
istiod's message, a good one is stored. istiod runs as its ServiceAccount under deploy/rbac and
sets the webhook's caBundle itself."""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e.harness import Cluster
from e2e.istio_crds import create_istio_object, install_crds, install_upstream_crds
from e2e.kube_objects import ensure_namespace
from e2e.test_rbac import istiod_kubeconfig
from tests.peers import ROOT, Istiod, Process, eventually, free_port

NS = "e2e-webhook"


async def istiod_patching(tmp_path: Path, kubeconfig: Path, port: int, processes: list[Process],
                          read: Callable[[], Awaitable[Any]]) -> Istiod:
    """istiod serving its webhooks on `port`, once it has set every caBundle of the configuration `read` returns."""
    istiod = Istiod(tmp_path, "--kubeconfig", str(kubeconfig), "--webhook-addr", f"127.0.0.1:{port}", ready_timeout=60)
    processes.append(istiod)

    async def patched() -> bool:
        return all(hook.client_config.ca_bundle for hook in (await read()).webhooks)

    await eventually(patched, 10, "istiod to set the webhooks' caBundle")
    return istiod


def vs(name: str, weight: int) -> dict:
    return {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": name, "namespace": NS},
            "spec": {"hosts": ["echo"], "http": [{"route": [{"destination": {"host": "echo"}, "weight": weight}]}]}}


async def test_api_server_refuses_what_istiod_refuses(
    cluster: Cluster, kube: client.ApiClient, tmp_path: Path, processes: list[Process]
) -> None:
    admission = client.AdmissionregistrationV1Api(kube)
    await install_crds(kube)
    await ensure_namespace(kube, NS)
    kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    port = free_port()
    config = yaml.safe_load((ROOT / "deploy" / "webhooks" / "validation.yaml").read_text())
    # No Service routes to a process in this cluster: the same webhook, addressed by URL.
    config["webhooks"][0]["clientConfig"] = {"url": f"https://127.0.0.1:{port}/validate", "caBundle": ""}
    await admission.create_validating_webhook_configuration(config)
    try:
        istiod = await istiod_patching(tmp_path, kubeconfig, port, processes, functools.partial(
            admission.read_validating_webhook_configuration, config["metadata"]["name"]))
        with pytest.raises(ApiException) as refused:
            await create_istio_object(kube, vs("bad", -1))
        message = json.loads(refused.value.body)["message"]
        print("kube-apiserver said:", message)
        assert refused.value.status == 400
        assert message == ('admission webhook "validation.istio.io" denied the request: configuration is invalid: '
                           f"VirtualService {NS}/bad spec.http[0].route[0]: weight: -1 < 0")
        await create_istio_object(kube, vs("good", 100))
        with pytest.raises(ApiException) as refused:  # Istio's ValidateProxyConfig message
            await create_istio_object(kube, {"apiVersion": "networking.istio.io/v1beta1", "kind": "ProxyConfig",
                                             "metadata": {"name": "bad", "namespace": NS}, "spec": {"concurrency": -1}})
        assert json.loads(refused.value.body)["message"].endswith(
            f"ProxyConfig {NS}/bad spec: concurrency: concurrency must be greater than or equal to 0")
        assert "Forbidden" not in istiod.text()
    finally:
        # With failurePolicy Fail and istiod gone, the webhook would refuse every later Istio object.
        await admission.delete_validating_webhook_configuration(config["metadata"]["name"])


async def test_kinds_istiod_does_not_implement_are_let_in_with_a_warning_and_logged(
    cluster: Cluster, kube: client.ApiClient, tmp_path: Path, processes: list[Process]
) -> None:
    """A cluster moving from Istio's istiod keeps Istio's CRDs and its WasmPlugins, Telemetries...:
    creating one is allowed with the webhook's warning, and istiod logs once that it has no effect."""
    admission = client.AdmissionregistrationV1Api(kube)
    custom = client.CustomObjectsApi(kube)
    await install_crds(kube)
    await install_upstream_crds(kube, ["Telemetry", "WasmPlugin"])
    await ensure_namespace(kube, NS)
    kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    port = free_port()
    config = yaml.safe_load((ROOT / "deploy" / "webhooks" / "validation.yaml").read_text())
    config["metadata"]["name"] = "istio-validator-unimplemented"
    config["webhooks"][0]["clientConfig"] = {"url": f"https://127.0.0.1:{port}/validate", "caBundle": ""}
    await admission.create_validating_webhook_configuration(config)
    wasm = {"apiVersion": "extensions.istio.io/v1alpha1", "kind": "WasmPlugin", "metadata": {"name": "lua", "namespace": NS},
            "spec": {"url": "oci://registry.example/plugins/auth:1.0"}}
    try:
        istiod = await istiod_patching(tmp_path, kubeconfig, port, processes, functools.partial(
            admission.read_validating_webhook_configuration, config["metadata"]["name"]))
        _, _, headers = await custom.create_namespaced_custom_object_with_http_info(
            "extensions.istio.io", "v1alpha1", NS, "wasmplugins", wasm)
        warnings = headers.getall("Warning", [])
        print("kube-apiserver warned:", warnings)
        assert any("WasmPlugin is not implemented by this istiod" in w for w in warnings)
        _, _, headers = await custom.create_namespaced_custom_object_with_http_info(
            "telemetry.istio.io", "v1", NS, "telemetries",
            {"apiVersion": "telemetry.istio.io/v1", "kind": "Telemetry", "metadata": {"name": "mesh", "namespace": NS},
             "spec": {"accessLogging": [{"providers": [{"name": "envoy"}]}]}})
        assert any("Telemetry is not implemented" in w for w in headers.getall("Warning", []))
        await eventually(lambda: f"object=WasmPlugin/{NS}/lua" in istiod.text()
                         and f"object=Telemetry/{NS}/mesh" in istiod.text(), 15,
                         "istiod to log the objects it does not implement")
        assert istiod.text().count(f"object=WasmPlugin/{NS}/lua") == 1
    finally:
        await admission.delete_validating_webhook_configuration(config["metadata"]["name"])
        # Other tests share this API server; istioctl analyze would read these.
        for group, version, plural, name in (("extensions.istio.io", "v1alpha1", "wasmplugins", "lua"),
                                             ("telemetry.istio.io", "v1", "telemetries", "mesh")):
            try:
                await custom.delete_namespaced_custom_object(group, version, NS, plural, name)
            except ApiException as error:
                if error.status != 404:
                    raise

"""`istiod install`: the rendered manifests server-side applied (field manager `istiod-install`),
then a wait until istiod's Deployment has rolled out, as `istioctl install` does."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import ApiClient, ApiException
from kubernetes_asyncio.dynamic import DynamicClient

from istiod.kubeapi import api_client
from istiod.sources.kube import describe_error

log = logging.getLogger(__name__)
FIELD_MANAGER = "istiod-install"


class InstallError(RuntimeError):
    """An object the API server refused, or a rollout that did not finish in time."""


def rolled_out(deployment: dict[str, Any]) -> bool:
    """As `kubectl rollout status`: the newest generation seen, every replica updated and ready."""
    status, spec = deployment.get("status") or {}, deployment.get("spec") or {}
    want = spec.get("replicas", 1)
    return bool(status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 1)
                and status.get("updatedReplicas", 0) >= want and status.get("readyReplicas", 0) >= want >= 1)


async def apply(api: ApiClient, path: str, obj: dict[str, Any]) -> None:
    """A server-side apply, forced: this installer owns what it sets. (The dynamic client's own
    server_side_apply returns the raw response unchecked, so a refusal would pass unseen.)"""
    await api.call_api(path, "PATCH", query_params=[("fieldManager", FIELD_MANAGER), ("force", "true")],
                       header_params={"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"},
                       body=obj, auth_settings=["BearerToken"], response_types_map={"200": "object", "201": "object"})


async def install(objects: list[dict[str, Any]], namespace: str, kubeconfig: Path | None, timeout: float) -> None:
    async with await api_client(kubeconfig) as api:
        dynamic = await DynamicClient(api)
        namespaces = await dynamic.resources.get(api_version="v1", kind="Namespace")
        for obj in [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}, *objects]:
            what = f"{obj['kind']} {obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}".replace(" /", " ")
            try:
                resource = namespaces if obj["kind"] == "Namespace" else await dynamic.resources.get(
                    api_version=obj["apiVersion"], kind=obj["kind"])
                await apply(api, resource.path(name=obj["metadata"]["name"], namespace=obj["metadata"].get("namespace")), obj)
            except ApiException as error:
                raise InstallError(f"{what}: {describe_error(error)}: {_message(error)}") from None
            log.info("applied %s", what)
        deployment_names = [str(o["metadata"]["name"]) for o in objects if o["kind"] == "Deployment"]
        if not deployment_names:
            return
        name = deployment_names[0]  # istiod, or a revision's istiod-<rev>
        deployments = await dynamic.resources.get(api_version="apps/v1", kind="Deployment")
        deadline = time.monotonic() + timeout
        while True:
            deployment = (await dynamic.get(deployments, name=name, namespace=namespace)).to_dict()
            if rolled_out(deployment):
                log.info("%s is ready in %s", name, namespace)
                return
            if time.monotonic() > deadline:
                status = deployment.get("status") or {}
                raise InstallError(f"Deployment {namespace}/{name} not ready after {timeout:g}s "
                                   f"(ready {status.get('readyReplicas', 0)} of {deployment['spec'].get('replicas', 1)})")
            await asyncio.sleep(1)


def _message(error: ApiException) -> str:
    """The API server's own words (a Status object's message), e.g. which field is invalid."""
    try:
        return str(json.loads(error.body or b"{}")["message"])
    except (TypeError, ValueError, KeyError):
        return ""

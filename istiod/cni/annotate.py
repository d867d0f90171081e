"""Marking a captured pod `ambient.istio.io/redirection: enabled`, as istio-cni does, through the
Kubernetes API (a JSON merge patch of that one annotation; removal patches it to null)."""

from __future__ import annotations

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.cni.membership import REDIRECTION_ENABLED
from istiod.model.workload import AMBIENT_REDIRECTION_ANNOTATION


class KubeAnnotator:
    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)

    async def mark(self, namespace: str, name: str, enabled: bool) -> None:
        """Set or clear the annotation; a pod already gone is no error."""
        patch = {"metadata": {"annotations": {AMBIENT_REDIRECTION_ANNOTATION: REDIRECTION_ENABLED if enabled else None}}}
        try:
            await self.core.patch_namespaced_pod(  # type: ignore[call-arg]  # a kwargs passthrough the stubs omit
                name, namespace, patch, _content_type="application/merge-patch+json", _request_timeout=30)
        except ApiException as error:
            if error.status != 404:
                raise

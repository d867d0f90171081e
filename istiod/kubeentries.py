"""WorkloadEntries in the Kubernetes API, for auto-registration and health (istiod/autoregistration.py):
read, created, replaced (with their resourceVersion, so a concurrent change is a Conflict), their
status replaced, and deleted."""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.autoregistration import Conflict
from istiod.model.config.kinds import BY_KIND

_KIND = BY_KIND["WorkloadEntry"]
_VERSION = "v1"


class KubeEntryStore:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = client.CustomObjectsApi(api)

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            body: dict[str, Any] = await self.api.get_namespaced_custom_object(
                _KIND.group, _VERSION, namespace, _KIND.plural, name)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return body

    async def list(self) -> list[dict[str, Any]]:
        listed = await self.api.list_cluster_custom_object(_KIND.group, _VERSION, _KIND.plural)
        return list(listed.get("items") or [])

    async def create(self, body: dict[str, Any]) -> None:
        await self._conflicting(self.api.create_namespaced_custom_object(
            _KIND.group, _VERSION, body["metadata"]["namespace"], _KIND.plural, body))

    async def replace(self, body: dict[str, Any]) -> None:
        metadata = body["metadata"]
        await self._conflicting(self.api.replace_namespaced_custom_object(
            _KIND.group, _VERSION, metadata["namespace"], _KIND.plural, metadata["name"], body))

    async def replace_status(self, body: dict[str, Any]) -> None:
        metadata = body["metadata"]
        await self._conflicting(self.api.replace_namespaced_custom_object_status(
            _KIND.group, _VERSION, metadata["namespace"], _KIND.plural, metadata["name"], body))

    async def delete(self, namespace: str, name: str, resource_version: str) -> None:
        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(resource_version=resource_version) if resource_version else None)
        try:
            await self._conflicting(self.api.delete_namespaced_custom_object(
                _KIND.group, _VERSION, namespace, _KIND.plural, name, body=options))
        except ApiException as error:
            if error.status != 404:
                raise

    @staticmethod
    async def _conflicting(call: Any) -> None:
        try:
            await call
        except ApiException as error:
            if error.status == 409:
                raise Conflict(str(error.reason)) from None
            raise

"""Writes the Gateway API status the conversion computed (GatewayClass, Gateway, routes, BackendTLSPolicy), and creates
the GatewayClass `istio` when it is missing, as istiod does. Leader-elected: only one replica writes.

Each pass compares the snapshot's wanted status with the status the informers last saw and patches
only what differs; a condition unchanged in status keeps its lastTransitionTime. Of a route's
parents (a policy's ancestors), only those of our controllerNames are ours to replace. A failed write is logged and tried
again on the next pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod import logs
from istiod.model.config.gateway_api import GROUP, GatewayApiConfig
from istiod.model.config.gateway_conversion import BUILTIN_CLASSES, CONTROLLER, MESH_CONTROLLER
from istiod.sources.convert import ObjectKey
from istiod.sources.gateway_api import RESOURCES
from istiod.sources.kube import API_ERRORS, describe_error
from istiod.sources.store import Store

log = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _with_times(wanted: list[dict[str, Any]], current: list[Any], now: str) -> list[dict[str, Any]]:
    """Conditions with lastTransitionTime: the current one's while its status is unchanged."""
    before = {c.get("type"): c for c in current if isinstance(c, dict)}
    result = []
    for condition in wanted:
        old = before.get(condition["type"])
        kept = old.get("lastTransitionTime") if old is not None and old.get("status") == condition["status"] else None
        result.append({**condition, "lastTransitionTime": kept or now})
    return result

CONTROLLERS = (CONTROLLER, MESH_CONTROLLER)  # the parents of routes that are ours to write


def merged_status(kind: str, wanted: Mapping[str, Any], current: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The status to write: `wanted` with the current transition times, and for a route's parents (a
    policy's ancestors) those of other controllers kept."""
    for entries, ref_key in (("parents", "parentRef"), ("ancestors", "ancestorRef")):
        if entries not in wanted:
            continue
        ours = []
        current_entries = [p for p in current.get(entries) or [] if isinstance(p, dict)]
        for entry in wanted[entries]:
            old = next((p for p in current_entries if p.get("controllerName") in CONTROLLERS
                        and p.get(ref_key) == entry[ref_key]), {})
            ours.append({**entry, "conditions": _with_times(entry["conditions"], old.get("conditions") or [], now)})
        others = [p for p in current_entries if p.get("controllerName") not in CONTROLLERS]
        return {**current, entries: others + ours}
    status = {**current, **wanted, "conditions": _with_times(wanted["conditions"], current.get("conditions") or [], now)}
    if "listeners" in wanted:
        old_listeners = {x.get("name"): x for x in current.get("listeners") or [] if isinstance(x, dict)}
        status["listeners"] = [{**x, "conditions": _with_times(x["conditions"], (old_listeners.get(x["name"]) or {})
                                                               .get("conditions") or [], now)}
                               for x in wanted["listeners"]]
    return status


class GatewayStatusWriter:
    def __init__(self, api: client.ApiClient, store: Store, config: Callable[[], GatewayApiConfig],
                 interval: float = 1.0) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.store = store
        self.config = config
        self.interval = interval
        self._classes_created: set[str] = set()

    async def run(self) -> None:
        while True:
            await self.write(self.config())
            await asyncio.sleep(self.interval)

    async def write(self, converted: GatewayApiConfig) -> None:
        for name in converted.missing_classes:
            if name not in self._classes_created:
                await self._create_class(name)
        now = _now()
        for (kind, namespace, name), wanted in converted.statuses.items():
            stored = self.store.get(ObjectKey(kind, namespace, name))
            if stored is None:
                continue
            current = stored.raw.get("status") or {}
            status = merged_status(kind, wanted, current, now)
            if _without_times(status) == _without_times(current):
                continue
            try:
                await self._patch(kind, namespace, name, status)
                log.info(logs.event("gateway api status written", kind=kind, object=f"{namespace}/{name}"))
            except API_ERRORS as error:
                log.warning(logs.event("gateway api status not written", kind=kind, object=f"{namespace}/{name}",
                                       error=describe_error(error)))

    async def _patch(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        body = {"status": status}
        merge: dict[str, Any] = {"_content_type": MERGE_PATCH}  # a JSON patch is the client's default
        served = RESOURCES[kind]
        if kind == "GatewayClass":
            await self.custom.patch_cluster_custom_object_status(served.group, served.version, served.plural, name,
                                                                 body, **merge)
        else:
            await self.custom.patch_namespaced_custom_object_status(served.group, served.version, namespace,
                                                                    served.plural, name, body, **merge)

    async def _create_class(self, name: str) -> None:
        controller, description = BUILTIN_CLASSES[name]
        body = {"apiVersion": f"{GROUP}/v1", "kind": "GatewayClass", "metadata": {"name": name},
                "spec": {"controllerName": controller, "description": description}}
        try:
            await self.custom.create_cluster_custom_object(GROUP, "v1", "gatewayclasses", body)
            log.info(logs.event("gatewayclass created", gatewayclass=name, controller=controller))
            self._classes_created.add(name)
        except ApiException as error:
            if error.status == 409:
                self._classes_created.add(name)
            else:
                log.warning(logs.event("gatewayclass not created", gatewayclass=name, error=describe_error(error)))
        except API_ERRORS as error:
            log.warning(logs.event("gatewayclass not created", gatewayclass=name, error=describe_error(error)))


def _without_times(status: Mapping[str, Any]) -> Any:
    """A status compared without lastTransitionTime (which only a change of status moves)."""
    if isinstance(status, Mapping):
        return {k: _without_times(v) for k, v in status.items() if k != "lastTransitionTime"}
    if isinstance(status, list):
        return [_without_times(v) for v in status]
    return status

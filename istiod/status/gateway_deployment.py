"""Keeps each Gateway of class `istio` or `istio-waypoint` deployed, as istiod's gateway deployment controller: its
ServiceAccount, Deployment and Service, and the HorizontalPodAutoscaler and PodDisruptionBudget its
ConfigMap overlays ask for (istiod/model/config/gateway_deployment.py), server-side applied with
istiod's field manager, and deleted once the Gateway is gone. Leader-elected: only one replica writes.
Overlays istiod cannot apply leave that Gateway's objects as they were, with one log line.

A pass that finds the Gateways changed (and one every RESYNC seconds, which also puts back an
object deleted by hand) lists the objects labelled with our Gateway class and applies what differs.
Deletion does not rely on the garbage collector (an API server without kube-controller-manager has
none): of those objects, the pass deletes the ones whose owner Gateway (by uid) the API server no
longer has, asked once more before each delete. Objects without a Gateway owner reference are never
touched. A failed call is logged and tried again on the next pass.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod import logs
from istiod.model.config.gateway_api import GROUP, KubernetesGateway
from istiod.model.config.gateway_conversion import CONTROLLER
from istiod.model.config.gateway_deployment import (
    CLASS_NAME_LABEL, DEPLOYED_CLASSES, ParametersError, customized, deployed, infrastructure_of, objects, overlays,
)
from istiod.sources.kube import API_ERRORS, describe_error
from istiod.sources.store import Store

log = logging.getLogger(__name__)
APPLY_PATCH = "application/apply-patch+yaml"
_Key = tuple[str, str, str]  # (kind, namespace, name)
RESYNC = 30.0  # seconds: the cluster's objects are listed when a Gateway changes, and at least this often


class _KindCalls(NamedTuple):
    """The API calls for one deployed kind: list it in all namespaces, apply it, delete it."""

    list_all: Any
    apply: Any
    delete: Any


class GatewayDeployer:
    def __init__(self, api: client.ApiClient, store: Store, variables: Callable[[], Mapping[str, str]],
                 system_namespace: str, interval: float = 2.0) -> None:
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        autoscaling, policy = client.AutoscalingV2Api(api), client.PolicyV1Api(api)
        # By kind, in the order istiod applies them.
        self._calls: dict[str, _KindCalls] = {
            "ServiceAccount": _KindCalls(core.list_service_account_for_all_namespaces,
                                         core.patch_namespaced_service_account, core.delete_namespaced_service_account),
            "Deployment": _KindCalls(apps.list_deployment_for_all_namespaces, apps.patch_namespaced_deployment,
                                     apps.delete_namespaced_deployment),
            "Service": _KindCalls(core.list_service_for_all_namespaces, core.patch_namespaced_service,
                                  core.delete_namespaced_service),
            "HorizontalPodAutoscaler": _KindCalls(autoscaling.list_horizontal_pod_autoscaler_for_all_namespaces,
                                                  autoscaling.patch_namespaced_horizontal_pod_autoscaler,
                                                  autoscaling.delete_namespaced_horizontal_pod_autoscaler),
            "PodDisruptionBudget": _KindCalls(policy.list_pod_disruption_budget_for_all_namespaces,
                                              policy.patch_namespaced_pod_disruption_budget,
                                              policy.delete_namespaced_pod_disruption_budget),
        }
        self.custom = client.CustomObjectsApi(api)
        self.store = store
        self.variables = variables
        self.system_namespace = system_namespace  # where a class's default overlays live
        self._refused: dict[tuple[str, str], str] = {}  # Gateways whose overlays failed: said once each
        self.interval = interval
        self._applied: dict[_Key, dict[str, Any]] = {}  # what this replica last applied, to write only changes
        self._wanted: dict[_Key, dict[str, Any]] | None = None
        self._listed = 0.0  # when the cluster's objects were last listed

    async def run(self) -> None:
        while True:
            await self.reconcile()
            await asyncio.sleep(self.interval)

    async def reconcile(self) -> None:
        variables = self.variables()
        wanted: dict[_Key, dict[str, Any]] = {}
        config_maps = list(self.store.values("ConfigMap"))
        refused: dict[tuple[str, str], str] = {}
        for stored in self.store.objects("KubernetesGateway"):
            gateway: KubernetesGateway = stored.value
            infrastructure = infrastructure_of(stored.raw)
            if not (deployed(gateway) and infrastructure.uid):
                continue
            where = (gateway.meta.namespace, gateway.meta.name)
            try:
                bodies = customized(objects(gateway, infrastructure, variables),
                                    overlays(gateway, config_maps, self.system_namespace))
            except ParametersError as error:
                refused[where] = str(error)
                if self._refused.get(where) != refused[where]:
                    log.warning(logs.event("gateway not deployed", gateway=f"{where[0]}/{where[1]}", reason=str(error)))
                continue
            for body in bodies:
                wanted[(body["kind"], gateway.meta.namespace, body["metadata"]["name"])] = body
        # A refused Gateway wants nothing, before and after its deletion: its going is a change too.
        gone_or_new = refused.keys() != self._refused.keys()
        self._refused = refused
        now = time.monotonic()
        if wanted == self._wanted and not gone_or_new and now - self._listed < RESYNC:
            return  # nothing changed here; what changed in the cluster is found at the next resync
        try:
            existing = await self._existing()
        except API_ERRORS as error:
            log.warning(logs.event("gateway deployments not listed", error=describe_error(error)))
            return
        self._wanted, self._listed = wanted, now
        for key, body in wanted.items():
            if key in existing and self._applied.get(key) == body:
                continue
            try:
                await self._apply(key, body)
                self._applied[key] = body
                log.info(logs.event("gateway deployment applied", kind=key[0], object=f"{key[1]}/{key[2]}"))
            except API_ERRORS as error:
                log.warning(logs.event("gateway deployment not applied", kind=key[0], object=f"{key[1]}/{key[2]}",
                                       error=describe_error(error)))
                self._wanted = None  # tried again on the next pass
        for key, owner in existing.items():
            if key not in wanted:
                await self._delete_if_orphaned(key, owner)

    async def _existing(self) -> dict[_Key, tuple[str, str]]:
        """The objects of our class's Gateways, with their owner Gateway's (name, uid)."""
        selector = f"{CLASS_NAME_LABEL} in ({','.join(DEPLOYED_CLASSES)})"
        found: dict[_Key, tuple[str, str]] = {}
        for kind, calls in self._calls.items():
            result = await calls.list_all(label_selector=selector)
            for item in result.items:
                owner = next((o for o in item.metadata.owner_references or []
                              if o.kind == "Gateway" and o.api_version.startswith(f"{GROUP}/")), None)
                if owner is not None:
                    found[(kind, item.metadata.namespace, item.metadata.name)] = (owner.name, owner.uid)
        return found

    async def _apply(self, key: _Key, body: dict[str, Any]) -> None:
        kind, namespace, name = key
        options: dict[str, Any] = {"field_manager": CONTROLLER, "force": True, "_content_type": APPLY_PATCH}
        await self._calls[kind].apply(name, namespace, body, **options)

    async def _delete_if_orphaned(self, key: _Key, owner: tuple[str, str]) -> None:
        """Deletes an object whose owner Gateway the API server does not have (its informer may lag)."""
        kind, namespace, name = key
        try:
            gateway = await self.custom.get_namespaced_custom_object(GROUP, "v1", namespace, "gateways", owner[0])
            if (gateway.get("metadata") or {}).get("uid") == owner[1]:
                return  # there, just not ours to deploy any more (another class, addresses): kept, as istiod
        except ApiException as error:
            if error.status != 404:
                log.warning(logs.event("gateway not read", gateway=f"{namespace}/{owner[0]}", error=describe_error(error)))
                return
        except API_ERRORS as error:
            log.warning(logs.event("gateway not read", gateway=f"{namespace}/{owner[0]}", error=describe_error(error)))
            return
        delete = self._calls[kind].delete
        try:
            await delete(name, namespace)
            log.info(logs.event("gateway deployment deleted", kind=kind, object=f"{namespace}/{name}",
                                gateway=owner[0]))
        except ApiException as error:
            if error.status != 404:
                log.warning(logs.event("gateway deployment not deleted", kind=kind, object=f"{namespace}/{name}",
                                       error=describe_error(error)))
        except API_ERRORS as error:
            log.warning(logs.event("gateway deployment not deleted", kind=kind, object=f"{namespace}/{name}",
                                   error=describe_error(error)))
        self._applied.pop(key, None)

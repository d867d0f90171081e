"""The root-cert publisher: ConfigMap `istio-ca-root-cert` (key `root-cert.pem`) in every namespace.

istiod's namespace controller: Namespaces come from the store (the Namespace informer), the
ConfigMaps of that name from their own informer (a field selector), and a namespace whose ConfigMap
is missing or holds another root is queued and written (created, or updated keeping its other
keys). Only the leader runs it. Skipped, as istiod skips them: kube-public, kube-node-lease and
local-path-storage, terminating namespaces, and namespaces the discovery selectors leave out.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.ca.root import ROOT_CERT_FILE, CaBundle
from istiod.sources.convert import ObjectKey
from istiod.backoff import Backoff
from istiod.sources.kube import API_ERRORS, Informer, describe_error
from istiod.sources.namespaces import NamespaceFilter
from istiod.sources.store import Change, EventType, Store

log = logging.getLogger(__name__)
CONFIGMAP = "istio-ca-root-cert"
ELECTION = "istio-namespace-controller-election"  # the ConfigMap lock its leader holds, named as istiod names it
LABELS = {"istio.io/config": "true"}
IGNORED_NAMESPACES = frozenset({"kube-public", "kube-node-lease", "local-path-storage"})  # kube-system is kept, as istiod does
REQUEST_TIMEOUT = 10.0
RETRY = Backoff()  # a namespace whose write failed is tried again, up to every 30 s


class RootCertPublisher:
    def __init__(self, api: client.ApiClient, store: Store, namespaces: NamespaceFilter,
                 namespaces_synced: asyncio.Event, watch_timeout: int = 300) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.store = store
        self.namespaces = namespaces
        self.namespaces_synced = namespaces_synced
        self.watch_timeout = watch_timeout
        self.roots = ""
        self._configmaps: dict[str, dict[str, Any]] = {}  # namespace -> its istio-ca-root-cert, as last seen
        self._queue: dict[str, None] = {}  # namespaces to reconcile, in order, each once
        self._failures: dict[str, int] = {}
        self._wake = asyncio.Event()
        store.subscribe(self._on_store_change)

    def publish(self, bundle: CaBundle) -> None:
        """The CA's roots, at start and whenever a plugged-in CA is reloaded."""
        self.roots = bundle.roots_pem
        self._enqueue_all()

    async def run(self) -> None:
        """The leader's work: watch the ConfigMaps, and keep every namespace's one right."""
        list_call = functools.partial(self.core.list_config_map_for_all_namespaces, field_selector=f"metadata.name={CONFIGMAP}")
        informer = Informer("ConfigMap", list_call, self, self.watch_timeout)
        watching = asyncio.create_task(informer.run(), name="informer-ConfigMap")
        try:
            await self.namespaces_synced.wait()
            await informer.synced.wait()
            self._enqueue_all()
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queue:
                    namespace = next(iter(self._queue))
                    del self._queue[namespace]
                    await self._reconcile(namespace)
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            self._configmaps.clear()  # the next term relists

    # The informer's writer: ConfigMaps named istio-ca-root-cert, as the API has them.

    def apply(self, body: dict[str, Any]) -> None:
        namespace = _namespace(body)
        self._configmaps[namespace] = body
        if _root_of(body) != self.roots:
            self._enqueue(namespace)

    def delete(self, body: dict[str, Any]) -> None:
        namespace = _namespace(body)
        self._configmaps.pop(namespace, None)
        self._enqueue(namespace)

    def replace(self, kind: str, items: list[dict[str, Any]]) -> None:
        self._configmaps = {_namespace(body): body for body in items}
        self._enqueue_all()

    def _on_store_change(self, change: Change) -> None:
        if change.key.kind != "Namespace":
            return
        if change.type is EventType.DELETED:
            self._failures.pop(change.key.name, None)
        else:
            self._enqueue(change.key.name)

    def _enqueue(self, namespace: str) -> None:
        self._queue[namespace] = None
        self._wake.set()

    def _enqueue_all(self) -> None:
        for key in sorted(self.store.keys("Namespace")):
            self._enqueue(key.name)

    def _wanted(self, namespace: str) -> bool:
        if not self.roots or namespace in IGNORED_NAMESPACES:
            return False
        stored = self.store.get(ObjectKey("Namespace", "", namespace))
        if stored is None or (stored.raw.get("status") or {}).get("phase") == "Terminating":
            return False
        return self.namespaces.selected(namespace)

    async def _reconcile(self, namespace: str) -> None:
        current = self._configmaps.get(namespace)
        if not self._wanted(namespace) or (current is not None and _root_of(current) == self.roots):
            self._failures.pop(namespace, None)
            return
        try:
            if current is None:
                written = await self._create(namespace)
            else:
                written = await self._update(current)
        except ApiException as error:
            if error.status == 404 and current is None:
                return  # the namespace went away since we saw it
            self._retry(namespace, describe_error(error))
        except API_ERRORS as error:
            self._retry(namespace, describe_error(error))
        else:
            # Known at once, so a namespace queued again before the watch reports it is not written twice.
            self._configmaps[namespace] = self.api.sanitize_for_serialization(written)
            self._failures.pop(namespace, None)

    async def _create(self, namespace: str) -> object:
        body: Any = {"apiVersion": "v1", "kind": "ConfigMap",  # the client takes plain dicts too
                     "metadata": {"name": CONFIGMAP, "namespace": namespace, "labels": LABELS},
                     "data": {ROOT_CERT_FILE: self.roots}}
        created = await self.core.create_namespaced_config_map(namespace, body, _request_timeout=REQUEST_TIMEOUT)
        log.info("root-cert publisher: created ConfigMap %s/%s", namespace, CONFIGMAP)
        return created

    async def _update(self, current: dict[str, Any]) -> object:
        """As istiod: our key set to the root, any other keys kept; the resourceVersion guards against races."""
        namespace = _namespace(current)
        body: Any = {**current, "apiVersion": "v1", "kind": "ConfigMap",
                     "data": {**(current.get("data") or {}), ROOT_CERT_FILE: self.roots}}
        updated = await self.core.replace_namespaced_config_map(CONFIGMAP, namespace, body,
                                                                _request_timeout=REQUEST_TIMEOUT)
        log.info("root-cert publisher: updated ConfigMap %s/%s to the current root", namespace, CONFIGMAP)
        return updated

    def _retry(self, namespace: str, reason: str) -> None:
        attempt = self._failures.get(namespace, 0)
        self._failures[namespace] = attempt + 1
        delay = RETRY.delay(attempt)
        log.warning("root-cert publisher: ConfigMap %s/%s not written: %s; retrying in %.1fs",
                    namespace, CONFIGMAP, reason, delay)
        asyncio.get_running_loop().call_later(delay, self._enqueue, namespace)


def _namespace(body: dict[str, Any]) -> str:
    return str((body.get("metadata") or {}).get("namespace", ""))


def _root_of(body: dict[str, Any]) -> str | None:
    return (body.get("data") or {}).get(ROOT_CERT_FILE)

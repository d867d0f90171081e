"""Kubernetes source: list+watch informers (kubernetes-asyncio) feeding the same store as the config dir.

Each kind has one informer: it lists (paged), diffs the list against the store (vanished objects
become deletions), then watches from the list's resourceVersion with bookmarks. A watch that ends
on its server-side timeout is resumed from the last resourceVersion; a 410 Gone or a broken watch
relists. Failures back off exponentially with full jitter. Objects that fail conversion are logged
and skipped (keeping their last good state) without stopping the informer.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.backoff import Backoff
from istiod.model.config.kinds import BY_KIND as CONFIG_BY_KIND, CONFIG_KINDS, UNIMPLEMENTED_KINDS
from istiod.revision import labels_in_revision
from istiod.sources.convert import CLUSTER_SCOPED, ConversionError, ObjectKey, object_key
from istiod.sources.gateway_api import RESOURCES as GATEWAY_API_RESOURCES
from istiod.model.labels import Selector
from istiod.sources.namespaces import NamespaceFilter
from istiod.sources.store import Store
from istiod.sources.unimplemented import UnimplementedReporter

log = logging.getLogger(__name__)
ListCall = Callable[..., Awaitable[Any]]
SECRETS_FIELD_SELECTOR = "type!=helm.sh/release.v1,type!=kubernetes.io/service-account-token"  # istiod's
# Gateways' parameters: every ConfigMap but istiod's leader-election locks, renewed every few seconds.
CONFIG_MAPS_FIELD_SELECTOR = "metadata.name!=istio-namespace-controller-election,metadata.name!=istio-analyze-leader"
API_ERRORS = (ApiException, aiohttp.ClientError, asyncio.TimeoutError, OSError)  # what a call to the API may raise


class Gone(Exception):
    """The resourceVersion we watch from is older than the API server keeps (410)."""


def list_calls(api: client.ApiClient) -> dict[str, ListCall]:
    """The list call of every kind istiod reads; namespaced kinds across all namespaces."""
    core, discovery, batch = client.CoreV1Api(api), client.DiscoveryV1Api(api), client.BatchV1Api(api)
    return {
        "Namespace": core.list_namespace,
        "Node": core.list_node,
        "PersistentVolume": core.list_persistent_volume,
        "Service": core.list_service_for_all_namespaces,
        "Pod": core.list_pod_for_all_namespaces,
        "PersistentVolumeClaim": core.list_persistent_volume_claim_for_all_namespaces,
        "EndpointSlice": discovery.list_endpoint_slice_for_all_namespaces,
        "Job": batch.list_job_for_all_namespaces,
        "CronJob": batch.list_cron_job_for_all_namespaces,
        # Gateways' credentials; never the kinds istiod leaves out either (Helm releases, tokens).
        "Secret": functools.partial(core.list_secret_for_all_namespaces, field_selector=SECRETS_FIELD_SELECTOR),
        "ConfigMap": functools.partial(core.list_config_map_for_all_namespaces, field_selector=CONFIG_MAPS_FIELD_SELECTOR),
    }


def istio_list_calls(api: client.ApiClient) -> dict[str, ListCall]:
    """Istio's config kinds, across all namespaces, at their newest version (v1, ProxyConfig's v1beta1;
    every version has the same schema)."""
    custom = client.CustomObjectsApi(api)
    return {k.kind: functools.partial(custom.list_cluster_custom_object, k.group, k.versions[-1], k.plural)
            for k in CONFIG_KINDS}


def unimplemented_list_calls(api: client.ApiClient) -> dict[str, ListCall]:
    """Istio's kinds this istiod does not implement, at a version Istio's CRDs serve."""
    custom = client.CustomObjectsApi(api)
    return {k.kind: functools.partial(custom.list_cluster_custom_object, k.group, k.storage, k.plural)
            for k in UNIMPLEMENTED_KINDS}


def gateway_api_list_calls(api: client.ApiClient) -> dict[str, ListCall]:
    """The Gateway API's kinds: the standard channel's at v1 (v1.6.0 serves every kind we read there),
    the experimental channel's X kinds at theirs."""
    custom = client.CustomObjectsApi(api)
    return {kind: functools.partial(custom.list_cluster_custom_object, r.group, r.version, r.plural)
            for kind, r in GATEWAY_API_RESOURCES.items()}


class Writer(Protocol):
    """Where an informer puts what it lists and watches (the store's KubeWriter, or a controller's cache)."""

    def apply(self, body: dict[str, Any]) -> object: ...

    def delete(self, body: dict[str, Any]) -> None: ...

    def replace(self, kind: str, items: list[dict[str, Any]]) -> None: ...


class _RawWatch(watch.Watch):
    """The library's watch, minus turning each event into a model object we would not use."""

    def get_return_type(self, func: object) -> str:
        return ""


class Informer:
    def __init__(
        self,
        kind: str,
        list_call: ListCall,
        writer: Writer,
        watch_timeout: int = 300,
        page_size: int = 500,
        backoff: Backoff = Backoff(),
        optional: bool = False,
    ) -> None:
        self.kind = kind
        # An optional kind whose resource the API does not serve (a CRD not installed) counts as
        # synced and empty, and is retried until it appears, as istiod does with Istio's CRDs.
        self.optional = optional
        self.list_call = list_call
        self.writer = writer
        self.watch_timeout = watch_timeout
        self.page_size = page_size
        self.backoff = backoff
        self.resource_version: str | None = None  # None: the next step is a relist
        self.synced = asyncio.Event()
        self.relists = 0
        self.gone = 0  # relists forced by 410
        self.events = 0  # watch events seen, bookmarks included: a watch that delivers works

    async def run(self) -> None:
        failures = 0  # rounds in a row in which no watch made progress
        while True:
            progress = self.events
            try:
                if self.resource_version is None:
                    await self.relist()
                    self.synced.set()
                await self.watch()
                failures = 0  # the watch ran to its server-side timeout: the path works
                continue
            except Gone as error:
                self.gone += 1
                reason, gone = str(error), True
            except (*API_ERRORS, ValueError) as error:
                reason, gone = describe_error(error), False
                if self.optional and isinstance(error, ApiException) and error.status == 404:
                    reason = "not served (CRD not installed?); read as empty until it is"
                    self.synced.set()
            self.resource_version = None
            if self.events > progress:
                failures = 0  # it worked for a while: retry soon
            # Only a list that works while every watch fails at once (a proxy cutting long requests,
            # RBAC without watch) keeps failing: the backoff grows so relists cannot hammer the API.
            delay = 0.0 if gone and failures == 0 else self.backoff.delay(failures)
            failures += 1
            log.warning("informer %s: %s; relisting in %.2fs (attempt %d)", self.kind, reason, delay, failures)
            await asyncio.sleep(delay)

    async def relist(self) -> None:
        """List every page, apply it, and delete what the store has that the list lacks."""
        objects: list[dict[str, Any]] = []
        token = None
        while True:
            page = await self._list_page(token)
            objects.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                break
        self.relists += 1
        self.writer.replace(self.kind, objects)
        self.resource_version = (page.get("metadata") or {}).get("resourceVersion") or None
        log.info("informer %s: listed %d objects at resourceVersion %s", self.kind, len(objects), self.resource_version)

    async def _list_page(self, token: str | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"limit": self.page_size, "_preload_content": False, "_request_timeout": 60}
        if token:
            kwargs["_continue"] = token
        response = await self.list_call(**kwargs)
        try:
            body = await response.read()
        finally:
            response.release()
        if response.status == 410:
            raise Gone(f"list continue token expired: {body[:200]!r}")
        if response.status != 200:
            raise ApiException(status=response.status, reason=body[:300].decode(errors="replace"))
        return json.loads(body)

    async def watch(self) -> None:
        """Watch from resource_version until the server ends the watch; raises when it breaks."""
        stream = _RawWatch()
        timeout = aiohttp.ClientTimeout(sock_connect=10, sock_read=self.watch_timeout + 60)
        try:
            async for event in stream.stream(
                self.list_call,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout,
                _request_timeout=timeout,
            ):
                self._on_event(event)
        except ApiException as error:
            if error.status == 410:
                raise Gone(f"watch from resourceVersion {self.resource_version} is too old") from None
            raise
        finally:
            await stream.close()

    def _on_event(self, event: Mapping[str, Any]) -> None:
        self.events += 1
        kind, body = event.get("type"), event.get("raw_object")
        if not isinstance(body, dict):
            raise ValueError(f"watch event without an object: {str(event)[:200]}")
        version = (body.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            self.resource_version = version or self.resource_version
            return
        body.setdefault("kind", self.kind)
        if kind in ("ADDED", "MODIFIED"):
            self.writer.apply(body)
        elif kind == "DELETED":
            self.writer.delete(body)
        self.resource_version = version or self.resource_version


class KubeWriter:
    """Applies informer objects to the store, through the namespace filter, logging bad ones. Istio
    config labelled `istio.io/rev` for another revision is not this control plane's (Istio's
    LabelsInRevision): it is left out, and one relabelled away is deleted."""

    def __init__(self, store: Store, namespaces: NamespaceFilter, revision: str = "") -> None:
        self.store = store
        self.namespaces = namespaces
        self.revision = revision
        # Objects in namespaces the filter leaves out, kept so a namespace that starts to match
        # can be filled in without a relist.
        self._excluded: dict[ObjectKey, dict[str, Any]] = {}

    def apply(self, body: dict[str, Any]) -> ObjectKey | None:
        key = self._key(body)
        if key is None:
            return None
        # Nothing here reads the field managers, and for a Pod they can outweigh what is read (the
        # store keeps each object as listed): dropped on the way in, as Istio's informers do.
        if isinstance(metadata := body.get("metadata"), dict):
            metadata.pop("managedFields", None)
        if key.kind == "Namespace":
            self._write(body)
            self._refilter(key.name)
        elif key.kind in CONFIG_BY_KIND and not labels_in_revision((body.get("metadata") or {}).get("labels"),
                                                                   self.revision):
            self._excluded.pop(key, None)
            self.store.delete(key)
        elif key.namespace and not self.namespaces.selected(key.namespace):
            self._excluded[key] = body
            self.store.delete(key)
        else:
            self._write(body)
        return key

    def delete(self, body: dict[str, Any]) -> None:
        key = self._key(body)
        if key is not None:
            self._remove(key)

    def replace(self, kind: str, items: list[dict[str, Any]]) -> None:
        """A full list of one kind: apply it, and delete every object of that kind it lacks."""
        listed = {self.apply({"kind": kind, **body}) for body in items}
        vanished = (self.store.keys(kind) | {k for k in self._excluded if k.kind == kind}) - listed
        for key in vanished:
            log.info("kube %s vanished while not watched; deleting", key)
            self._remove(key)

    def reselect(self, selectors: tuple[Selector, ...]) -> None:
        """New discovery selectors (a mesh config change): every namespace is filtered again."""
        if selectors == self.namespaces.selectors:
            return
        names = [o.key.name for o in self.store.objects("Namespace")]
        before = {name: self.namespaces.selected(name) for name in names}
        self.namespaces.selectors = selectors
        for name in names:
            self.namespaces.update(name, self._labels(name))
            if self.namespaces.selected(name) != before[name]:
                self._move(name)

    def _remove(self, key: ObjectKey) -> None:
        self._excluded.pop(key, None)
        self.store.delete(key)
        if key.kind == "Namespace":
            self.namespaces.forget(key.name)

    def _write(self, body: dict[str, Any]) -> None:
        try:
            self.store.apply(body)
        except ConversionError as error:
            log.error("kube %s; skipped, keeping its last good state", error)

    def _refilter(self, namespace: str) -> None:
        """The namespace's labels may have moved it in or out of the discovery selectors."""
        if self.namespaces.update(namespace, self._labels(namespace)):
            self._move(namespace)

    def _labels(self, namespace: str) -> dict[str, str]:
        namespace_object = self.store.get(ObjectKey("Namespace", "", namespace))
        return dict(namespace_object.value.labels) if namespace_object else {}

    def _move(self, namespace: str) -> None:
        """Fill in or take out a namespace's objects after it moved in or out of the selectors."""
        if self.namespaces.selected(namespace):
            for key in [k for k in self._excluded if k.namespace == namespace]:
                self._write(self._excluded.pop(key))
        else:
            for stored in [o for o in self.store.objects() if o.key.namespace == namespace and o.key.kind not in CLUSTER_SCOPED]:
                self._excluded[stored.key] = dict(stored.raw)
                self.store.delete(stored.key)

    @staticmethod
    def _key(body: Any) -> ObjectKey | None:
        try:
            return object_key(body)
        except ConversionError as error:
            log.error("kube object skipped: %s", error)
            return None


class KubeSource:
    """Every informer, started Namespaces first so the namespace filter is known before the rest."""

    def __init__(self, api: client.ApiClient, store: Store, namespaces: NamespaceFilter, watch_timeout: int = 300,
                 revision: str = "") -> None:
        self.api = api
        self.writer = KubeWriter(store, namespaces, revision)
        self.informers = {
            kind: Informer(kind, call, self.writer, watch_timeout) for kind, call in list_calls(api).items()
        }
        self.informers.update(
            (kind, Informer(kind, call, self.writer, watch_timeout, optional=True))
            for kind, call in {**istio_list_calls(api), **gateway_api_list_calls(api)}.items())
        self.unimplemented = UnimplementedReporter()
        self.informers.update(
            (kind, Informer(kind, call, self.unimplemented, watch_timeout, optional=True))
            for kind, call in unimplemented_list_calls(api).items())
        self.synced = asyncio.Event()

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.informers["Namespace"].run(), name="informer-Namespace")]
        try:
            await self.informers["Namespace"].synced.wait()
            tasks += [
                asyncio.create_task(informer.run(), name=f"informer-{kind}")
                for kind, informer in self.informers.items()
                if kind != "Namespace"
            ]
            await asyncio.gather(*(i.synced.wait() for i in self.informers.values()))
            self.synced.set()
            log.info("kube informers synced: %s", ", ".join(self.informers))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def describe_error(error: BaseException) -> str:
    if isinstance(error, ApiException):
        return f"API error {error.status} {error.reason or ''}".strip()
    return f"{type(error).__name__}: {error}"

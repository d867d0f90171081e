"""In-cluster analysis (istiod's PILOT_ENABLE_ANALYSIS): the leader runs the config analyzers over
the store and writes each Istio object's `status` as istiod's status manager does:

    status:
      observedGeneration: "3"          # the generation analyzed (jsonpb: an int64 is a string)
      validationMessages:              # left out when there is none
      - type: {code: IST0101}
        level: ERROR
        documentationUrl: https://istio.io/latest/docs/reference/config/analysis/ist0101/

Other status fields (conditions) are kept. An object is written when it has messages or its status
still shows some (istiod clears only those it reported itself since it started; we also clear what
an earlier leader left). As istiod's, a round runs after 1 s without store changes, or at the latest
`interval` after the first change; the write names the resourceVersion analyzed, so an object
changed meanwhile is left to the next round. Only the elected replica (lock
`istio-analyze-leader`) runs this.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.model.config.analysis import (
    ERROR, INFO, KUBE_KINDS, WARNING, Message, Objects, Resource, analyze, documentation_url, selected,
)
from istiod.model.config.kinds import BY_KIND
from istiod.sources.kube import API_ERRORS, describe_error
from istiod.sources.store import Change, Store

log = logging.getLogger(__name__)
ELECTION = "istio-analyze-leader"  # istiod's lock for its analysis controller
QUIET = 1.0  # istiod's debounce: a round after this long without changes
REQUEST_TIMEOUT = 10.0
_LEVELS = {ERROR: "ERROR", WARNING: "WARNING", INFO: "INFO"}
# What the store holds besides Istio's kinds (ConfigMaps are not: the injection analyzer, which
# reports on Namespaces and Pods only, does not run).
_KINDS = frozenset(BY_KIND) | (frozenset(KUBE_KINDS) - {"ConfigMap", "Deployment"})


def validation_message(message: Message) -> dict[str, Any]:
    """AnalysisMessageBase as istiod writes it (jsonpb of the proto: code only, the level's name)."""
    return {"type": {"code": message.code}, "level": _LEVELS[message.level],
            "documentationUrl": documentation_url(message.code)}


def desired_status(body: Mapping[str, Any], messages: Iterable[Message]) -> dict[str, Any] | None:
    """The object's status once written with `messages`, or None when nothing needs writing (no
    message now nor shown, or exactly what it shows)."""
    current = dict(body.get("status") or {})
    found = [validation_message(m) for m in messages]
    if not found and not current.get("validationMessages"):
        return None
    status = {k: v for k, v in current.items() if k != "validationMessages"}
    generation = (body.get("metadata") or {}).get("generation") or 0
    if generation:
        status["observedGeneration"] = str(generation)
    if found:
        status["validationMessages"] = found
    return None if status == current else status


def resources(store: Store) -> list[Resource]:
    return [Resource(o.key.kind, o.key.namespace, o.key.name, o.raw) for kind in sorted(_KINDS)
            for o in store.objects(kind)]


class AnalysisController:
    def __init__(self, api: client.ApiClient, store: Store, synced: asyncio.Event, interval: float = 10.0) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.store = store
        self.synced = synced
        self.interval = interval
        self._changed = asyncio.Event()
        self._reported: set[str] = set()  # message lines logged, to log each once
        store.subscribe(self._on_change)

    def _on_change(self, change: Change) -> None:
        if change.key.kind in _KINDS:
            self._changed.set()

    async def run(self) -> None:
        """The leader's work: a round at once, then one per settled burst of changes."""
        await self.synced.wait()
        while True:
            await self.round()
            await self._settle()

    async def _settle(self) -> None:
        await self._changed.wait()
        first = time.monotonic()
        while True:
            self._changed.clear()
            left = first + self.interval - time.monotonic()
            try:
                await asyncio.wait_for(self._changed.wait(), min(QUIET, max(left, 0.0)))
            except TimeoutError:
                return
            if time.monotonic() - first >= self.interval:
                self._changed.clear()
                return

    async def round(self) -> None:
        read = resources(self.store)  # on the loop: the store changes there
        # Off the loop: analyzers walk pods per selector, which takes a while in a large cluster.
        messages = selected(await asyncio.to_thread(analyze, Objects(read, _KINDS)), None)
        self._log(messages)
        by_object: dict[tuple[str, str, str], list[Message]] = {}
        for m in messages:
            by_object.setdefault((m.resource.kind, m.resource.namespace, m.resource.name), []).append(m)
        for resource in read:
            if resource.kind not in BY_KIND:
                continue
            status = desired_status(resource.body, by_object.get((resource.kind, resource.namespace, resource.name), []))
            if status is not None:
                await self._write(resource, status)

    async def _write(self, resource: Resource, status: dict[str, Any]) -> None:
        kind = BY_KIND[resource.kind]
        metadata = resource.body.get("metadata") or {}
        # A merge patch with the resourceVersion analyzed: a newer object (409) waits for the next round.
        patch = {"metadata": {"resourceVersion": metadata.get("resourceVersion")},
                 "status": {**status, "validationMessages": status.get("validationMessages")}}  # None removes it
        try:
            await self.custom.patch_namespaced_custom_object_status(  # type: ignore[call-arg]  # stubs omit the kwargs
                kind.group, "v1", resource.namespace, kind.plural, resource.name, patch,
                _content_type="application/merge-patch+json", _request_timeout=REQUEST_TIMEOUT)
        except ApiException as error:
            if error.status in (404, 409):
                return  # gone or changed since: the store's event brings the next round
            log.warning("analysis: cannot write the status of %s: %s", resource.origin, describe_error(error))
        except API_ERRORS as error:
            log.warning("analysis: cannot write the status of %s: %s", resource.origin, describe_error(error))

    def _log(self, messages: list[Message]) -> None:
        """As istiod: each new Error or Warning once, and what is resolved."""
        current = {m.line() for m in messages}
        for m in messages:
            if m.line() not in self._reported and m.level in (ERROR, WARNING):
                log.warning("Configuration analysis: %s", m.line())
        for line in sorted(self._reported - current):
            log.info("Configuration analysis resolved: %s", line)
        self._reported = current

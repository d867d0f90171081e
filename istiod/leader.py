"""Leader election for istiod's leader-elected writers, with istiod's lock: a ConfigMap named by the
election whose annotation `control-plane.alpha.kubernetes.io/leader` holds the leader record (its
ConfigMapLock; istiod uses a coordination.k8s.io Lease only for per-revision elections), so our
istiod and Istio's, during a migration between them, contend for one lock and never both write.
The record is client-go's JSON with istiod's `holderKey`: the holder's revision. As istiod's
"prioritized" election, the default revision (the one the MutatingWebhookConfiguration
`istio-revision-tag-default` is labelled `istio.io/rev` with) takes the lock from another revision's
holder at once; otherwise revisions share one lock, so one writer runs across them all.

As client-go's elector, which istiod uses: the record names its holder and when it last renewed. A
replica takes the lock when it is absent, free (released) or its record has not changed for a whole
lease duration by our own clock (so clocks need not agree); every write carries the resourceVersion
it read, so of two replicas racing only one wins. The leader renews every retry period and stops its
work as soon as another holds the lock, or when it could not renew for the renew deadline, which
is shorter than the lease duration so it stops before anyone else may start. On shutdown the
leader hands the lock back (istiod's ReleaseOnCancel), so another replica takes over at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.revision import REV_LABEL
from istiod.sources.kube import API_ERRORS, describe_error

log = logging.getLogger(__name__)
REQUEST_TIMEOUT = 10.0
JITTER = 1.2  # client-go's: followers retry at 1-1.2 retry periods, so they do not move in step
RECORD = "control-plane.alpha.kubernetes.io/leader"  # client-go's annotation for a ConfigMap lock
KEY = "default"  # istiod's holderKey: its revision; the default revision never steals from itself
DEFAULT_TAG_WEBHOOK = "istio-revision-tag-default"  # its istio.io/rev label names the default revision


@dataclass(frozen=True, slots=True)
class LeaseTimings:
    """istiod's: a 30 s lease, renewed within 15 s, tried every 7.5 s."""

    duration: float = 30.0
    renew_deadline: float = 15.0
    retry_period: float = 7.5

    def check(self) -> None:
        if not self.duration > self.renew_deadline > JITTER * self.retry_period > 0:
            raise ValueError("leader election needs lease duration > renew deadline > 1.2 x retry period > 0")


@dataclass(frozen=True, slots=True)
class _Seen:
    """The lock as last read or written: its record (raw, as client-go compares it), who holds it, the
    ConfigMap it is in (for the next write's resourceVersion), and since when (monotonic)."""

    raw: str
    holder: str
    transitions: int
    acquired: str
    configmap: client.V1ConfigMap
    at: float


class LeaderElection:
    def __init__(self, api: client.ApiClient, namespace: str, name: str, identity: str,
                 timings: LeaseTimings = LeaseTimings(), key: str = KEY) -> None:
        self.api = client.CoreV1Api(api)
        self.admission = client.AdmissionregistrationV1Api(api)
        self.key = key
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timings = timings
        self._seen: _Seen | None = None

    @property
    def lease(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    async def run(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Forever: wait to lead, then run `work` until leadership ends; cancelled, hand the lock back."""
        while True:
            if await self._attempt():
                log.info("leader election: %s leads %s", self.identity, self.lease)
                await self._lead(work)
            await asyncio.sleep(self.timings.retry_period * random.uniform(1.0, JITTER))

    async def _attempt(self) -> bool:
        try:
            return await self._acquire_or_renew()
        except API_ERRORS as error:
            log.warning("leader election: %s: %s", self.lease, describe_error(error))
            return False

    async def _lead(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        worker = asyncio.create_task(work(), name=f"leader-{self.name}")
        renewer = asyncio.create_task(self._keep_renewing(), name=f"renew-{self.name}")
        release = True  # unless the lock is already lost
        try:
            done, _ = await asyncio.wait({worker, renewer}, return_when=asyncio.FIRST_COMPLETED)
            release = renewer not in done
            if worker in done:
                log.error("leader election: the work of %s stopped (%r); giving up %s",
                          self.identity, worker.exception(), self.lease)
        finally:
            worker.cancel()
            renewer.cancel()
            await asyncio.gather(worker, renewer, return_exceptions=True)
            if release:  # only once the work has stopped, so two leaders never overlap
                await self._release()

    async def _keep_renewing(self) -> None:
        """Returns when leadership is lost: another holds the lock, or no renewal for the renew deadline."""
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.timings.retry_period)
            left = renewed + self.timings.renew_deadline - time.monotonic()
            try:
                if not await asyncio.wait_for(self._acquire_or_renew(), max(left, 0.0)):
                    log.warning("leader election: %s lost %s to another replica", self.identity, self.lease)
                    return
                renewed = time.monotonic()
            except API_ERRORS as error:
                if time.monotonic() - renewed >= self.timings.renew_deadline:
                    log.warning("leader election: %s lost %s: no renewal for %gs (%s)", self.identity, self.lease,
                                self.timings.renew_deadline, describe_error(error))
                    return
                log.warning("leader election: cannot renew %s: %s", self.lease, describe_error(error))

    async def _acquire_or_renew(self) -> bool:
        now = _time(datetime.now(timezone.utc))
        try:
            configmap = await self.api.read_namespaced_config_map(self.name, self.namespace,
                                                                  _request_timeout=REQUEST_TIMEOUT)
        except ApiException as error:
            if error.status != 404:
                raise
            return await self._write(None, self._record(now, now, 0))
        raw = (configmap.metadata.annotations or {}).get(RECORD, "")
        parsed = _parse(raw)
        if parsed is None:
            log.warning("leader election: %s: annotation %s is not a leader record; left alone", self.lease, RECORD)
            return False
        record, holder, transitions = parsed
        if self._seen is None or self._seen.raw != raw:
            self._seen = _Seen(raw, holder, transitions, str(record.get("acquireTime") or now), configmap,
                               time.monotonic())
        else:  # unchanged record, but the ConfigMap's resourceVersion may have moved
            self._seen = _Seen(raw, holder, transitions, self._seen.acquired, configmap, self._seen.at)
        if (holder not in ("", self.identity) and time.monotonic() < self._seen.at + self.timings.duration
                and not await self._steals_from(str(record.get("holderKey") or ""))):
            return False  # another's, and renewed within a lease duration as far as we have seen
        if holder == self.identity:
            return await self._write(configmap, self._record(self._seen.acquired, now, transitions))
        return await self._write(configmap, self._record(now, now, transitions + 1))

    async def _steals_from(self, holder_key: str) -> bool:
        """istiod's prioritized election: the default revision takes the lock from another revision."""
        if holder_key == self.key:
            return False
        try:
            webhook = await self.admission.read_mutating_webhook_configuration(DEFAULT_TAG_WEBHOOK,
                                                                               _request_timeout=REQUEST_TIMEOUT)
        except ApiException as error:
            if error.status == 404:
                return False  # no default tag: no revision is preferred
            raise
        if (webhook.metadata.labels or {}).get(REV_LABEL) != self.key:
            return False
        log.info("leader election: %s (revision %s, the default) takes %s from revision %s", self.identity, self.key,
                 self.lease, holder_key)
        return True

    async def _write(self, configmap: client.V1ConfigMap | None, record: dict[str, Any]) -> bool:
        """Create the ConfigMap (None) or update the one read; False when another replica wrote first."""
        raw = json.dumps(record, separators=(",", ":"))
        try:
            if configmap is not None:
                configmap.metadata.annotations = {**(configmap.metadata.annotations or {}), RECORD: raw}
                written = await self.api.replace_namespaced_config_map(self.name, self.namespace, configmap,
                                                                       _request_timeout=REQUEST_TIMEOUT)
            else:
                body = client.V1ConfigMap(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace,
                                                                       annotations={RECORD: raw}))
                written = await self.api.create_namespaced_config_map(self.namespace, body,
                                                                      _request_timeout=REQUEST_TIMEOUT)
        except ApiException as error:
            if error.status == 409:
                return False
            raise
        self._seen = _Seen(raw, record["holderIdentity"], record["leaderTransitions"], record["acquireTime"], written,
                           time.monotonic())
        return True

    async def _release(self) -> None:
        seen = self._seen
        if seen is None or seen.holder != self.identity:
            return
        try:
            async with asyncio.timeout(2.0):
                # A renewal cancelled in flight may still land first, and then this write conflicts:
                # read the lock again and retry while the record is still ours.
                for _ in range(3):
                    now = _time(datetime.now(timezone.utc))
                    record = self._record(now, now, seen.transitions)  # as client-go's release: no holder, a 1 s lease
                    record.update(holderIdentity="", holderKey="", leaseDurationSeconds=1)
                    if await self._write(seen.configmap, record):
                        log.info("leader election: %s released %s", self.identity, self.lease)
                        return
                    configmap = await self.api.read_namespaced_config_map(self.name, self.namespace,
                                                                          _request_timeout=REQUEST_TIMEOUT)
                    raw = (configmap.metadata.annotations or {}).get(RECORD, "")
                    parsed = _parse(raw)
                    if parsed is None or parsed[1] != self.identity:
                        return  # another's already
                    seen = _Seen(raw, self.identity, seen.transitions, seen.acquired, configmap, time.monotonic())
                log.warning("leader election: could not release %s: it kept changing", self.lease)
        except API_ERRORS as error:
            log.warning("leader election: could not release %s: %s", self.lease, describe_error(error))

    def _record(self, acquired: str, renewed: str, transitions: int) -> dict[str, Any]:
        """client-go's LeaderElectionRecord as istiod's fork writes it."""
        return {
            "holderIdentity": self.identity,
            "holderKey": self.key,
            "leaseDurationSeconds": max(1, round(self.timings.duration)),
            "acquireTime": acquired,
            "renewTime": renewed,
            "leaderTransitions": transitions,
        }


def _time(moment: datetime) -> str:
    """metav1.Time as JSON: RFC 3339 in whole seconds, UTC."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(raw: str) -> tuple[dict[str, Any], str, int] | None:
    """The leader record of the lock's annotation, its holder and transitions; None if it is not one."""
    try:
        record = json.loads(raw) if raw else {}
        return record, str(record.get("holderIdentity") or ""), int(record.get("leaderTransitions") or 0)
    except (ValueError, TypeError, AttributeError):
        return None

"""Lease-based leader election (coordination.k8s.io/v1), for istiod's leader-elected writers.

As client-go's elector, which istiod uses: a Lease names its holder and when it last renewed. A
replica takes the Lease when it is absent, free (released) or has not changed for a whole lease
duration by our own clock (so clocks need not agree); every write carries the resourceVersion it
read, so of two replicas racing only one wins. The leader renews every retry period and stops its
work as soon as another holds the Lease, or when it could not renew for the renew deadline, which
is shorter than the lease duration so it stops before anyone else may start. On shutdown the
leader hands the Lease back (istiod's ReleaseOnCancel), so another replica takes over at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.sources.kube import API_ERRORS, describe_error

log = logging.getLogger(__name__)
REQUEST_TIMEOUT = 10.0
JITTER = 1.2  # client-go's: followers retry at 1-1.2 retry periods, so they do not move in step


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
    """The Lease as last read or written: who holds it, at which resourceVersion, since when (monotonic)."""

    holder: str
    version: str
    transitions: int
    at: float


class LeaderElection:
    def __init__(self, api: client.ApiClient, namespace: str, name: str, identity: str,
                 timings: LeaseTimings = LeaseTimings()) -> None:
        self.api = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timings = timings
        self._seen: _Seen | None = None

    @property
    def lease(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    async def run(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Forever: wait to lead, then run `work` until leadership ends; cancelled, hand the Lease back."""
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
        release = True  # unless the Lease is already lost
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
        """Returns when leadership is lost: another holds the Lease, or no renewal for the renew deadline."""
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
        now = datetime.now(timezone.utc)
        try:
            lease = await self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as error:
            if error.status != 404:
                raise
            return await self._write(self._body(now, now, 0, None))
        spec = lease.spec or client.V1LeaseSpec()
        holder, version = spec.holder_identity or "", lease.metadata.resource_version
        if self._seen is None or (self._seen.holder, self._seen.version) != (holder, version):
            self._seen = _Seen(holder, version, spec.lease_transitions or 0, time.monotonic())
        if holder not in ("", self.identity) and time.monotonic() < self._seen.at + self.timings.duration:
            return False  # another's, and renewed within a lease duration as far as we have seen
        if holder == self.identity:
            acquired, transitions = spec.acquire_time or now, self._seen.transitions
        else:
            acquired, transitions = now, self._seen.transitions + 1
        return await self._write(self._body(acquired, now, transitions, version))

    async def _write(self, body: dict[str, Any]) -> bool:
        """Create (no resourceVersion) or update the Lease; False when another replica wrote first."""
        try:
            if "resourceVersion" in body["metadata"]:
                written = await self.api.replace_namespaced_lease(self.name, self.namespace, body,  # type: ignore[arg-type]  # a dict body is sent as is
                                                                  _request_timeout=REQUEST_TIMEOUT)
            else:
                written = await self.api.create_namespaced_lease(self.namespace, body,  # type: ignore[arg-type]  # as above
                                                                 _request_timeout=REQUEST_TIMEOUT)
        except ApiException as error:
            if error.status == 409:
                return False
            raise
        spec = body["spec"]
        self._seen = _Seen(spec["holderIdentity"], written.metadata.resource_version, spec["leaseTransitions"],
                           time.monotonic())
        return True

    async def _release(self) -> None:
        seen = self._seen
        if seen is None or seen.holder != self.identity:
            return
        now = datetime.now(timezone.utc)
        body = self._body(now, now, seen.transitions, seen.version)
        body["spec"].update(holderIdentity="", leaseDurationSeconds=1)
        try:
            await asyncio.wait_for(self._write(body), 2.0)
            log.info("leader election: %s released %s", self.identity, self.lease)
        except API_ERRORS as error:
            log.warning("leader election: could not release %s: %s", self.lease, describe_error(error))

    def _body(self, acquired: datetime, renewed: datetime, transitions: int, version: str | None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if version is not None:
            metadata["resourceVersion"] = version
        return {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": max(1, round(self.timings.duration)),
                "acquireTime": _micro_time(acquired),
                "renewTime": _micro_time(renewed),
                "leaseTransitions": transitions,
            },
        }


def _micro_time(moment: datetime) -> str:
    """Kubernetes MicroTime: RFC 3339 with exactly six fractional digits (isoformat drops them at .000000)."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

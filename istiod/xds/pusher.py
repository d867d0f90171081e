"""The pusher: debounces store changes into new snapshots and announces them.

Like istiod (PILOT_DEBOUNCE_AFTER, PILOT_DEBOUNCE_MAX, PILOT_ENABLE_EDS_DEBOUNCE): a change starts
a debounce window that closes after `debounce_after` of quiet, or `debounce_max` after the first
change, whichever comes first; then one snapshot is built from the store (from the previous one and
what changed) and handed to every subscriber (the ADS server), which pushes only what changed.

Changes that only move endpoints (Pods, EndpointSlices, WorkloadEntries: istiod's incremental EDS
updates) are not held to that when nothing else is pending: they are published `debounce_after`
after the first of them however busy the churn (quiet or not), or at once with EDS debounce off.
Joined by any other change, the batch is debounced as a whole, as istiod merges the two.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone

from istiod import logs
from istiod.model.builder import build_snapshot
from istiod.model.config.kinds import BY_KIND
from istiod.model.mesh import MeshConfig
from istiod.model.snapshot import Snapshot
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Change, Store

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PushEvent:
    """Why and when a snapshot was published."""

    snapshot: Snapshot
    reason: dict[str, int] = field(default_factory=dict)  # changed objects by kind
    debounce_seconds: float = 0.0
    build_seconds: float = 0.0
    full: bool = True
    configs: tuple[str, ...] = ()  # the Istio config objects that changed, as istiod names them (Kind/ns/name)


Subscriber = Callable[[PushEvent], None]


# Kinds whose changes only move endpoints: pushed on the incremental EDS path.
ENDPOINT_KINDS = frozenset({"Pod", "EndpointSlice", "WorkloadEntry"})


class Pusher:
    def __init__(
        self, store: Store, debounce_after: float = 0.1, debounce_max: float = 10.0, mesh: MeshConfig = MeshConfig(),
        eds_debounce: bool = True, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.mesh = mesh
        self.jwks: Mapping[str, str] = {}  # set by the JWKS resolver
        self.debounce_after = debounce_after
        self.debounce_max = debounce_max
        self.eds_debounce = eds_debounce
        self._clock = clock
        self.snapshot = build_snapshot(store, _version(0), mesh=mesh)
        self._subscribers: list[Subscriber] = []
        self._changed: set[ObjectKey] = set()
        self._kinds: Counter[str] = Counter()
        self._first = 0.0
        self._last = 0.0
        self._endpoints_only = True  # every pending change only moves endpoints
        self._wake = asyncio.Event()
        self._count = 0
        store.subscribe(self.on_change)

    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def on_change(self, change: Change) -> None:
        now = self._clock()
        if not self._changed:
            self._first = now
        self._last = now
        self._changed.add(change.key)
        self._kinds[change.key.kind] += 1
        self._endpoints_only = self._endpoints_only and change.key.kind in ENDPOINT_KINDS
        self._wake.set()

    def due_in(self, now: float) -> float:
        """Seconds until the pending changes are to be published; 0: now."""
        if self._endpoints_only:
            if not self.eds_debounce:
                return 0.0
            closes = self._first + self.debounce_after
        else:
            closes = min(self._last + self.debounce_after, self._first + self.debounce_max)
        return max(0.0, closes - now)

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            while self._changed and (delay := self.due_in(self._clock())) > 0:
                await asyncio.sleep(delay)
            if self._changed:
                self.publish()
            self._wake.clear()

    def publish(self, full: bool = False) -> PushEvent:
        """Build a snapshot from the store now and announce it; `full` rebuilds every endpoint."""
        changed, reason = self._changed, dict(self._kinds)
        debounced = self._clock() - self._first if changed else 0.0
        self._changed, self._kinds, self._endpoints_only = set(), Counter(), True
        self._wake.clear()
        started = time.perf_counter()
        self._count += 1
        self.snapshot = build_snapshot(self.store, _version(self._count), self.snapshot, None if full else changed, self.mesh,
                                      self.jwks)
        configs = tuple(sorted(f"{k.kind}/{k.namespace}/{k.name}" for k in changed if k.kind in BY_KIND))
        event = PushEvent(self.snapshot, reason, debounced, time.perf_counter() - started, full, configs)
        shown = ",".join(configs[:_CONFIGS_LOGGED]) + (f",+{len(configs) - _CONFIGS_LOGGED} more"
                                                        if len(configs) > _CONFIGS_LOGGED else "")
        log.info(logs.event("push", version=self.snapshot.version, reason=reason or "full",
                            build_ms=round(event.build_seconds * 1e3, 1), **({"configs": shown} if configs else {})))
        for subscriber in self._subscribers:
            subscriber(event)
        return event


_CONFIGS_LOGGED = 10  # a push of thousands of objects still logs one short line


def _version(count: int) -> str:
    """istiod's version shape: the time of the push and a counter."""
    return f"{datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}/{count}"

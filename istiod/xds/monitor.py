"""What the ADS server does, for operators: Istio's xDS and push metrics, and the last push's status.

The ADS server reports each event here as it happens; nothing is computed by walking connections
or resources at scrape time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Histogram

from istiod import logs, metrics
from istiod.xds import types
from istiod.xds.connection import Connection, Request, WatchedResource
from istiod.xds.pusher import PushEvent
from istiod.xds.wire import Outgoing

log = logging.getLogger(__name__)
MAX_PUSH_ERRORS = 20  # a push that breaks every proxy needs only a sample of the errors
# Go's codes.Code names, which Istio puts in the `err` label of pilot_xds_*_reject.
_CODE_NAMES = {c.value[0]: "".join(w.capitalize() for w in c.name.split("_")) for c in grpc.StatusCode}
_CODE_NAMES[0] = "OK"


@dataclass(frozen=True, slots=True)
class PushError:
    proxy: str
    type: str  # xDS short name: cds, eds, lds, rds
    message: str


@dataclass(frozen=True, slots=True)
class PushStatus:
    """One push: why, how long, and how many connected proxies got something from it."""

    version: str
    reason: Mapping[str, int]  # changed objects by kind; empty for a full push
    full: bool
    start: float  # wall clock of the first change that led to it
    debounce_seconds: float
    build_seconds: float
    proxies_connected: int  # when it was published
    proxies_pushed: int = 0  # got at least one response of this version
    responses_sent: int = 0
    end: float | None = None  # when the last proxy connected at publish time had handled it
    errors: tuple[PushError, ...] = ()
    configs: tuple[str, ...] = ()  # the Istio config objects that led to it


class AdsMonitor:
    def __init__(self) -> None:
        self.last_push: PushStatus | None = None
        self._start_monotonic = 0.0
        self._pending: set[str] = set()  # connections that have not handled the last push yet
        # pilot_xds_*_reject{node, err} is per proxy, but a proxy may have several connections (a
        # reconnect overlaps the old stream): a series goes only when no connection still has its NACK.
        self._rejecting: dict[tuple[str, str, str], set[str]] = {}  # (proxy, type, err) -> connections
        self._rejected: dict[str, set[tuple[str, str, str]]] = {}  # connection -> its (proxy, type, err)

    def published(self, event: PushEvent, connection_ids: Iterable[str], connected: int) -> None:
        """`connection_ids`: the connections the push concerns, of `connected` in all."""
        for kind, count in event.reason.items():
            metrics.PUSH_TRIGGERS.labels(type=metrics.trigger_type(kind)).inc(count)
        if not event.reason:
            metrics.PUSH_TRIGGERS.labels(type="global").inc()
        metrics.DEBOUNCE_TIME.observe(event.debounce_seconds)
        metrics.SERVICES.set(len(event.snapshot.services))
        waited = event.debounce_seconds + event.build_seconds
        self._start_monotonic = time.monotonic() - waited
        self._pending = set(connection_ids)
        self.last_push = PushStatus(
            version=event.snapshot.version,
            reason=dict(event.reason),
            full=event.full,
            start=time.time() - waited,
            debounce_seconds=event.debounce_seconds,
            build_seconds=event.build_seconds,
            proxies_connected=connected,
            end=None if self._pending else time.time(),
            configs=event.configs,
        )

    def connected(self, connection: Connection) -> None:
        metrics.XDS_CLIENTS.labels(version=_version(connection)).inc()

    def disconnected(self, connection: Connection) -> None:
        metrics.XDS_CLIENTS.labels(version=_version(connection)).dec()
        for key in self._rejected.pop(connection.id, ()):
            connections = self._rejecting[key]
            connections.discard(connection.id)
            if not connections:
                del self._rejecting[key]
                proxy, short, err = key
                metrics.XDS_REJECTS[short].remove(proxy, err)
        self._handled(connection.id)

    def dequeued(self, queued_seconds: float) -> None:
        metrics.PROXY_QUEUE_TIME.observe(queued_seconds)

    def response_sent(self, response: Outgoing, seconds: float) -> None:
        pushes, push_time, config_size = _per_type(response.type_url)
        pushes.inc()
        push_time.observe(seconds)
        config_size.observe(response.size)

    def write_timeout(self) -> None:
        metrics.XDS_WRITE_TIMEOUTS.inc()

    def pushed(self, connection: Connection, version: str, responses: int) -> None:
        """The connection handled a push of `version`, sending `responses` responses."""
        status = self.last_push
        if status is None or status.version != version:
            return
        if responses:
            self.last_push = dataclasses.replace(
                status, proxies_pushed=status.proxies_pushed + 1, responses_sent=status.responses_sent + responses
            )
        if connection.id in self._pending:
            metrics.PROXY_CONVERGENCE_TIME.observe(time.monotonic() - self._start_monotonic)
        self._handled(connection.id)

    def nacked(self, connection: Connection, watched: WatchedResource, request: Request) -> None:
        short = types.short_name(watched.type_url)
        err = _CODE_NAMES.get(request.error_detail.code, str(request.error_detail.code))
        metrics.TOTAL_XDS_REJECTS.labels(type=short).inc()
        if short in metrics.XDS_REJECTS:
            metrics.XDS_REJECTS[short].labels(node=connection.proxy.id, err=err).set(1)
            key = (connection.proxy.id, short, err)
            self._rejecting.setdefault(key, set()).add(connection.id)
            self._rejected.setdefault(connection.id, set()).add(key)
        status = self.last_push
        if status is not None and watched.version_sent == status.version and len(status.errors) < MAX_PUSH_ERRORS:
            error = PushError(connection.proxy.id, short, request.error_detail.message)
            self.last_push = dataclasses.replace(status, errors=(*status.errors, error))

    def _handled(self, connection_id: str) -> None:
        if connection_id not in self._pending:
            return
        self._pending.discard(connection_id)
        if not self._pending and self.last_push is not None:
            end = time.time()
            self.last_push = status = dataclasses.replace(self.last_push, end=end)
            if log.isEnabledFor(logging.DEBUG):  # not even the event's facts on every push otherwise
                log.debug(logs.event("push done", version=status.version, proxies=status.proxies_pushed,
                                     responses=status.responses_sent, seconds=round(end - status.start, 3)))


def _version(connection: Connection) -> str:
    return connection.proxy.istio_version or "unknown"


@functools.cache
def _per_type(type_url: str) -> tuple[Counter, Histogram, Histogram]:
    """A type's children of the per-response metrics: found once, not per response (labels() costs
    as much as the rest of the bookkeeping)."""
    short = types.short_name(type_url)
    return (metrics.XDS_PUSHES.labels(type=short), metrics.XDS_PUSH_TIME.labels(type=short),
            metrics.CONFIG_SIZE_BYTES.labels(type=short))

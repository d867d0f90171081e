"""Per-connection ADS state: the proxy, and per type what it watches, was sent and acknowledged."""

from __future__ import annotations

import asyncio
import itertools
import time
import weakref
from dataclasses import dataclass, field
from typing import TypeAlias

import grpc
from envoy.service.discovery.v3 import discovery_pb2

from istiod.autoregistration import Registered
from istiod.model.proxy import Proxy, with_workload_labels
from istiod.model.workload import Workload
from istiod.xds import types
from istiod.xds.cache import Resource

_connection_numbers = itertools.count(1)
_UNRESOLVED = object()
# At most how long a push of endpoints only waits for the client to answer the previous endpoints
# response (see Connection.next_event).
ANSWER_WAIT = 1.0
_process_tag = ""  # an xDS worker's, so connection IDs stay unique across istiod's processes


def tag_connections(tag: str) -> None:
    """Connection IDs of this process become `<proxy>-<tag><n>` (an xDS worker's `w<pid>.`)."""
    global _process_tag
    _process_tag = tag


class Held(dict[str, Resource]):
    """What a response left a client holding of one type, by name. Connections sent the same
    resources share one (see `of`), so it is never changed in place: replace it."""

    __slots__ = ("__weakref__", "_update", "_delta")

    @classmethod
    def of(cls, resources: list[Resource]) -> Held:
        """One per distinct list, however many connections hold it (the cache gives every connection
        the same Resource objects, so 2000 clients of one wildcard CDS share one)."""
        return cls._of(tuple(map(id, resources)), resources)

    @classmethod
    def _of(cls, key: tuple[int, ...], resources: list[Resource]) -> Held:
        shared = _held.get(key)
        if shared is None:
            shared = _held[key] = cls((r.name, r) for r in resources)
        return shared

    def delta_to(self, current: list[Resource]) -> tuple[list[Resource], list[str], Held]:
        """The resources of `current` whose content differs from what this holds, the names this holds
        that `current` has not, and `current` as a Held: worked out once for all the connections
        holding this that are given the same `current` (every ztunnel is sent the same Address
        table: comparing it whole for each was most of a pod change's cost)."""
        key = tuple(map(id, current))
        last = getattr(self, "_delta", None)
        if last is not None and last[0] == key:
            return last[1]  # type: ignore[no-any-return]
        after = Held._of(key, current)
        result = ([r for r in current if not r.same_as(self.get(r.name))], [n for n in self if n not in after], after)
        # Strong: while this lives, so do `after` and the resources whose identities are the key.
        self._delta = (key, result)
        return result

    def updated(self, fresh: list[Resource]) -> Held:
        """This with `fresh` in place of what it holds of their names (and any new ones last); made once
        for the connections holding this that get the same `fresh` (an endpoint change sends every
        Envoy the same few assignments), instead of a merge of all their assignments each."""
        key = tuple(map(id, fresh))
        last = getattr(self, "_update", None)
        # Weak: the newer must not keep alive the chain of every later one. While it lives, so do the
        # `fresh` it holds, so their identities in the key are theirs.
        shared = last[1]() if last is not None and last[0] == key else None
        if shared is None:
            shared = Held({**self, **{r.name: r for r in fresh}})
            self._update = (key, weakref.ref(shared))
        return shared


# Keyed by the resources' identities, which stay unique while the Held that refers to them lives;
# an entry goes with the last connection holding it.
_held: weakref.WeakValueDictionary[tuple[int, ...], Held] = weakref.WeakValueDictionary()


@dataclass(slots=True)
class WatchedResource:
    """One xDS type on one connection (istiod's WatchedResource)."""

    type_url: str
    names: list[str] | None  # None: wildcard
    nonce_sent: str = ""
    version_sent: str = ""
    nonce_acked: str = ""
    version_acked: str = ""
    nacked_nonce: str = ""
    last_error: str = ""  # the client's error_detail message of its last NACK, cleared by an ACK
    sent: dict[str, Resource] = field(default_factory=dict)  # what the last response held (a Held once sent)
    acked: dict[str, Resource] = field(default_factory=dict)  # what the last ACKed response held
    sent_at: float = 0.0
    names_key: int | None = None  # wire.names_key of the request that named `names` (SotW)

    @property
    def rejection(self) -> str:
        """The error of the proxy's NACK of the last response sent, if it NACKed that one."""
        return self.last_error if self.nacked_nonce == self.nonce_sent else ""

    def differs_from(self, resources: list[Resource]) -> bool:
        return len(resources) != len(self.sent) or any(not r.same_as(self.sent.get(r.name)) for r in resources)


@dataclass(frozen=True, slots=True)
class Closed:
    """The end of a stream, and the status it ends with."""

    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""


class StreamClosed(Exception):
    """Ends one stream with a status; raised where the reason is found, handled where the stream ends."""

    def __init__(self, closed: Closed) -> None:
        super().__init__(closed.details)
        self.closed = closed


class _Push:
    """The event that means "a newer snapshot is waiting"."""


def _resolve(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


Request: TypeAlias = discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest
Event: TypeAlias = Request | Closed | _Push
# What a push must regenerate: per type, the names (None: all the connection watches of it); a
# type not in it is unchanged. A push of everything has no scope (None).
PushScope: TypeAlias = dict[str, set[str] | None]


class Connection:
    """An ADS stream. Its events are handled by one task, in order, so state needs no locks.

    The client's requests wait in a one-slot queue (istiod's reqChannel): while the connection's task
    is busy, its reader stops reading and gRPC flow control holds the client back. Pushes coalesce
    into one flag, so a connection that falls behind costs one pending push, however many happen.
    """

    PUSH = _Push()

    def __init__(self, proxy: Proxy, peer: str, delta: bool = False) -> None:
        self.node = proxy  # as it connected; `proxy` carries its Pod's labels (relabel)
        self.proxy = proxy
        self._labelled_by: Workload | None | object = _UNRESOLVED
        self.peer = peer
        self.delta = delta  # DeltaAggregatedResources (incremental) rather than state of the world
        self.id = f"{proxy.id}-{_process_tag}{next(_connection_numbers)}"
        self.connected_at = time.time()
        self.registered: Registered | None = None  # the WorkloadEntry it controls (istiod/autoregistration.py)
        self.watched: dict[str, WatchedResource] = {}
        self.name_bytes = 0  # of the resource names it watches, all types (bounded: DiscoveryServer._bound_names)
        # Delta: clusters sent since the last endpoints response. Envoy warms each until it is sent
        # its endpoints again, and over delta it does not ask for them.
        self.endpoints_due: set[str] = set()
        # The one slot, and a future for whoever waits on it: an asyncio.Queue and Event would keep
        # four deques, about 3 kB, on each of thousands of mostly idle connections.
        self._request: Request | Closed | None = None
        self._request_key: int | None = None  # wire.names_key of the request in the slot
        self.names_key: int | None = None  # of the request next_event last returned
        self._taken: asyncio.Future[None] | None = None  # the reader waits on it while the slot is full
        self._woken: asyncio.Future[None] | None = None  # the connection's task waits on it for an event
        self._push_queued = False
        self._push_scope: PushScope | None = None
        self._queued_at = 0.0
        # Made within the stream's task. Held: asyncio.get_running_loop() makes a getpid() system call
        # each time, and every request and push waits on a new future.
        self._loop = asyncio.get_running_loop()

    def relabel(self, workload: Workload | None) -> None:
        """Take the labels of the proxy's Pod as the snapshot about to be used holds it (the same
        object until the Pod changes, so most events cost one comparison)."""
        if workload is not self._labelled_by:
            self._labelled_by = workload
            self.proxy = with_workload_labels(self.node, None if workload is None else workload.labels)

    async def received(self, request: Request | Closed, names_key: int | None = None) -> None:
        """From the reader: waits while the previous request is still unhandled. `names_key`: the
        request's wire.names_key, if the reader had its bytes."""
        while self._request is not None:
            self._taken = self._loop.create_future()
            await self._taken
        self._request, self._request_key = request, names_key
        _resolve(self._woken)

    def request_push(self, scope: PushScope | None = None) -> None:
        """Coalesce: one queued push covers every snapshot published until it runs, and the union
        of what they changed (everything, once any of them is a push of everything)."""
        if not self._push_queued:
            self._push_queued = True
            self._queued_at = time.monotonic()
            # The name sets are shared with other connections and never changed in place (merges
            # below make new ones): only the dict is this connection's.
            self._push_scope = None if scope is None else dict(scope)
            _resolve(self._woken)
        elif self._push_scope is not None:
            if scope is None:
                self._push_scope = None
                return
            for type_url, names in scope.items():
                held = self._push_scope.get(type_url, set())
                if held is None or names is None:
                    self._push_scope[type_url] = None
                else:
                    self._push_scope[type_url] = held | names

    async def next_event(self) -> Event:
        # Requests first, as istiod does: they are cheap (mostly ACKs) and a starting client waits on them.
        while True:
            if (request := self._request) is not None:
                self._request, self.names_key = None, self._request_key
                _resolve(self._taken)
                return request
            held = self._unanswered() if self._push_queued else 0.0
            if self._push_queued and held <= 0:
                return self.PUSH
            self._woken = self._loop.create_future()
            timer = self._loop.call_later(held, _resolve, self._woken) if held > 0 else None
            await self._woken
            if timer is not None:
                timer.cancel()

    def _unanswered(self) -> float:
        """Seconds a queued push of endpoints only is still to wait for a state-of-the-world client to
        answer (ACK or NACK) the previous endpoints response; 0: none. Under endpoint churn the changes
        made meanwhile then go in one response, and one ACK naming every cluster the client watches,
        rather than one each. Not for delta clients, whose ACKs name nothing: the wait (an ACK's trip
        through a busy server) cost their churn latency more than the responses it saved."""
        scope = self._push_scope
        watched = self.watched.get(types.ENDPOINT)
        if self.delta or scope is None or scope.keys() != {types.ENDPOINT} or watched is None or \
                watched.nonce_sent in ("", watched.nonce_acked, watched.nacked_nonce):
            return 0.0
        return watched.sent_at + ANSWER_WAIT - time.time()

    def push_started(self) -> tuple[float, PushScope | None]:
        """Seconds the push waited in this connection's queue, and what it must regenerate."""
        self._push_queued = False
        return time.monotonic() - self._queued_at, self._push_scope

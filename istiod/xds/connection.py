"""Per-connection ADS state: the proxy, and per type what it watches, was sent and acknowledged."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from istiod.model.proxy import Proxy
from istiod.xds.cache import Resource

_connection_numbers = itertools.count(1)


@dataclass
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
    sent: dict[str, Resource] = field(default_factory=dict)  # what the last response held
    acked: dict[str, Resource] = field(default_factory=dict)  # what the last ACKed response held
    sent_at: float = 0.0

    @property
    def rejection(self) -> str:
        """The error of the proxy's NACK of the last response sent, if it NACKed that one."""
        return self.last_error if self.nacked_nonce == self.nonce_sent else ""

    def differs_from(self, resources: list[Resource]) -> bool:
        return len(resources) != len(self.sent) or any(not r.same_as(self.sent.get(r.name)) for r in resources)


class Connection:
    """An ADS stream. Its events are handled by one task, in order, so state needs no locks."""

    PUSH = object()  # the event that means "a newer snapshot is waiting"

    def __init__(self, proxy: Proxy, peer: str) -> None:
        self.proxy = proxy
        self.peer = peer
        self.id = f"{proxy.id}-{next(_connection_numbers)}"
        self.connected_at = time.time()
        self.watched: dict[str, WatchedResource] = {}
        self.events: asyncio.Queue[object] = asyncio.Queue()
        self._push_queued = False
        self._queued_at = 0.0

    def request_push(self) -> None:
        """Coalesce: one queued push covers every snapshot published until it runs."""
        if not self._push_queued:
            self._push_queued = True
            self._queued_at = time.monotonic()
            self.events.put_nowait(self.PUSH)

    def push_started(self) -> float:
        """Seconds the push waited in this connection's queue."""
        self._push_queued = False
        return time.monotonic() - self._queued_at

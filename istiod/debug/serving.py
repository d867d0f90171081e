"""The HTTP servers of 8080, 15014, the webhooks' 15017 and the agent's 15020/15021: uvicorn with istiod's
read timeout and a connection cap.

uvicorn closes idle keep-alive connections, but holds a connection that never sends a complete
request forever. Like istiod's http.Server (ReadTimeout 30s), a whole request, headers and body,
must arrive within the read timeout of the connection opening or of its first byte after the last
response; and a port holds at most `max_connections`, the longest idle giving way to a new one. A
connection counts as busy only once its request is complete, so a slow body is not what holds a slot.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from istiod import logs
from istiod.connlimit import ACCEPT_BATCH, ConnectionCap

log = logging.getLogger(__name__)
_refusals = logs.Throttled(log)


def guarded_config(app: Any, read_timeout: float, max_connections: int) -> uvicorn.Config:
    """uvicorn's config for one of istiod's ports (8080, 15014, the webhooks' 15017) or the agent's
    (15020, 15021: one cap for the sockets served together)."""
    protocol = type("Protocol", (_GuardedH11,), {"cap": ConnectionCap(max_connections), "read_timeout": read_timeout})
    # log_config=None: uvicorn logs through our structured handler; no proxy headers, so the client
    # address the debug access check sees is the socket's peer.
    return uvicorn.Config(app, http=protocol, log_level="warning", lifespan="off", access_log=False,
                          log_config=None, proxy_headers=False, backlog=ACCEPT_BATCH)


class _GuardedH11(H11Protocol):
    cap: ClassVar[ConnectionCap]
    read_timeout: ClassVar[float]
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.cap.admit(self, transport.abort):
            _refusals.warning(logs.event("http: connection refused, every connection busy",
                                         port=self.server[1] if self.server else "", max_connections=self.cap.limit))
            transport.abort()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._receiving():
            self._arm()  # the first byte after a response: uvicorn's idle timer stops, this one starts
        super().data_received(data)
        if not self._receiving():
            self._disarm()
            self.cap.busy(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive (idle) timeout
        self.cap.idle(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.cap.release(self)
        super().connection_lost(exc)

    def _receiving(self) -> bool:
        """No complete request: between connecting (or the last response) and a request's last byte."""
        return self.cycle is None or self.cycle.response_complete or self.cycle.more_body

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout, self.transport.abort)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

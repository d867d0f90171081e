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
import posixpath
import re
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
    return uvicorn.Config(CleanPath(app), http=protocol, log_level="warning", lifespan="off", access_log=False,
                          log_config=None, proxy_headers=False, backlog=ACCEPT_BATCH)


class CleanPath:
    """Go's http.ServeMux, which serves istiod's and pilot-agent's ports, answers a path that is not clean
    (`//version`, `/debug/../ready`) with a 301 to the cleaned one; `istioctl version` asks for `//version`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "CONNECT":
            clean = clean_path(scope["path"])
            if clean != scope["path"]:
                query = scope.get("query_string", b"")
                location = clean.encode() + (b"?" + query if query else b"")
                body = b'<a href="' + location + b'">Moved Permanently</a>.\n\n' if scope["method"] == "GET" else b""
                await send({"type": "http.response.start", "status": 301,
                            "headers": [(b"location", location), (b"content-type", b"text/html; charset=utf-8"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def clean_path(path: str) -> str:
    """Go's net/http cleanPath: one slash between elements, `.` and `..` resolved, a trailing slash kept."""
    if not path.startswith("/"):
        path = "/" + path
    # normpath keeps a leading `//` (POSIX allows it a meaning); Go's path.Clean does not.
    cleaned = posixpath.normpath(re.sub("/{2,}", "/", path))
    return cleaned + "/" if path.endswith("/") and cleaned != "/" else cleaned


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

"""The agent's status ports: /healthz/ready (15021, and on 15020 as pilot-agent also serves it) and
/stats/prometheus (15020: Envoy's stats followed by the agent's own).

Ready means Envoy's admin says LIVE (it has its first CDS, EDS and LDS) and the agent is not
shutting down: readiness fails first when the agent drains, so endpoints are taken out of load
balancing before Envoy's listeners drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from istiod.agent.admin import EnvoyAdmin
from istiod.agent.metrics import SCRAPES, agent_exposition
from istiod.connlimit import HTTP_READ_TIMEOUT, MAX_CONNECTIONS, sized_cap
from istiod.debug.serving import guarded_config
from istiod.listen import listen_tcp

log = logging.getLogger(__name__)
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # SIGTERM is the agent's: it fails readiness and drains Envoy while this keeps answering


class StatusServer:
    def __init__(self, admin: EnvoyAdmin) -> None:
        self.admin = admin
        self.draining = False
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def ready(self) -> tuple[int, str]:
        if self.draining:
            return 503, "the agent is draining"
        try:
            status, body = await self.admin.request("GET", "/ready")
        except OSError as error:
            return 503, f"Envoy's admin is unreachable: {error}"
        state = body.strip()
        return (200, "") if status == 200 and state == "LIVE" else (503, f"Envoy is not ready: {state}")

    async def prometheus(self) -> bytes:
        SCRAPES.inc()
        try:
            status, envoy = await self.admin.request("GET", "/stats/prometheus")
        except OSError as error:
            log.warning("cannot scrape Envoy's stats: %s", error)
            envoy = ""
        else:
            if status != 200:
                log.warning("cannot scrape Envoy's stats: HTTP %d", status)
                envoy = ""
        if envoy and not envoy.endswith("\n"):
            envoy += "\n"
        return envoy.encode() + agent_exposition()

    def app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.get("/healthz/ready")
        async def healthz_ready() -> Response:
            status, reason = await self.ready()
            return PlainTextResponse(reason, status_code=status)

        @app.get("/stats/prometheus")
        async def stats_prometheus() -> Response:
            return Response(await self.prometheus(), media_type=PROMETHEUS_TEXT)

        return app

    async def start(self, *addresses: tuple[str, int]) -> list[int]:
        """Serves on every address; the ports bound, in order."""
        sockets = [listen_tcp(host, port) for host, port in addresses]
        # istiod's rules for its HTTP ports: a request within the read timeout, and a cap on connections
        # (one for every address together, the longest idle giving way) that fits in the open files
        # limit, so idle sockets cannot stop readiness and SDS.
        self._server = _Server(guarded_config(self.app(), HTTP_READ_TIMEOUT, sized_cap(MAX_CONNECTIONS, 1)))
        self._task = asyncio.create_task(self._server.serve(sockets=sockets), name="status")
        return [sock.getsockname()[1] for sock in sockets]

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait([self._task], timeout=5)

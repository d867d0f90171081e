"""The debug FastAPI app, served on the http (8080) and monitoring (15014) ports as istiod does.

It reads the snapshot, the store's objects and a read-only view of the ADS server, nothing else.
"""

from __future__ import annotations

import html
import platform
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from istiod import __version__, metrics
from istiod.debug import views
from istiod.debug.access import AccessPolicy
from istiod.debug.connections import Question, Unanswered, combined
from istiod.model.snapshot import Snapshot
from istiod.sources.store import StoredObject

# Every debug endpoint and what it shows: the /debug index is built from this.
DEBUG_ENDPOINTS = {
    "/debug/ui": "a page of services, connected proxies and their sync state, refreshed every few seconds",
    "/debug/registryz": "services in the registry, with ports and selectors",
    "/debug/endpointz": "endpoints per service and port: address, health, locality, workload, service account",
    "/debug/instancesz": "workloads (pods), with their Job/CronJob owners and mounted PersistentVolumes",
    "/debug/configz": "the Kubernetes objects in the config store",
    "/debug/adsz": "connected proxies: id, peer address, connected since, labels, metadata, watched resources",
    "/debug/connections": "connected proxies: id, peer address, connected since, watched resources",
    "/debug/syncz": "per proxy, the nonce sent and acknowledged for clusters, listeners, routes and endpoints",
    "/debug/push_status": "the last push: version, reason, duration, proxies pushed, errors",
    "/debug/config_dump?proxyID=": "the resources a proxy was sent, as an Envoy config dump",
    "/debug/sync_diff?proxyID=": "per type, which resources a proxy was sent but has not acknowledged",
}
PROBES = {"/ready": "200 once sources have synced, while istiod's certificate is fresh; else 503 and why", "/healthz": "200 while the process serves"}
MONITORING = {"/metrics": "Prometheus metrics", "/version": "istiod's version"}
_UI_PAGE = resources.files("istiod.debug").joinpath("ui.html").read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class DebugView:
    """The only way the debug app reads istiod's state; every member is a read."""

    snapshot: Callable[[], Snapshot]
    # Every xDS-serving process's answer (debug/connections.py), this one's first; Unanswered if one is missing.
    answers: Callable[[Question], Awaitable[list[Any]]]
    not_ready: Callable[[], str | None]  # why /ready fails, None when ready
    objects: Callable[[], Iterable[StoredObject]]

    async def ask(self, question: Question) -> Any:
        return combined(question, await self.answers(question))


def create_app(view: DebugView, access: AccessPolicy = AccessPolicy(), monitoring: bool = False) -> FastAPI:
    """The debug app; `monitoring` adds /metrics and /version as on istiod's port 15014.

    Handlers are async so they run on the event loop that owns the ADS state; sync handlers would
    run in a thread pool and read connections while the loop changes them.
    """
    app = FastAPI(title="istiod debug", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def check_access(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path == "/debug" or request.url.path.startswith("/debug/"):
            client = request.client.host if request.client else None
            refusal = await access.refusal(client, request.headers.get("authorization"))
            if refusal is not None:
                return _error(403, refusal)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, error: RequestValidationError) -> Response:
        return _error(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()))

    @app.exception_handler(Unanswered)
    async def unanswered(request: Request, error: Unanswered) -> Response:
        return _error(503, str(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        return _error(error.status_code, str(error.detail))

    @app.get("/ready")
    async def ready() -> Response:
        reason = view.not_ready()
        if reason is None:
            return Response("ready\n", media_type="text/plain")
        return Response(f"not ready: {reason}\n", status_code=503, media_type="text/plain")

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response("ok\n", media_type="text/plain")

    @app.get("/debug", response_class=HTMLResponse)
    async def index() -> str:
        return _index_page(monitoring)

    @app.get("/debug/ui", response_class=HTMLResponse)
    async def ui() -> str:
        return _UI_PAGE

    @app.get("/debug/registryz")
    async def registryz() -> list[dict[str, Any]]:
        return [views.service_json(s) for s in sorted(view.snapshot().services.values(), key=lambda s: s.hostname)]

    @app.get("/debug/endpointz")
    async def endpointz() -> dict[str, dict[str, list[dict[str, Any]]]]:
        return views.endpointz(view.snapshot())

    @app.get("/debug/instancesz")
    async def instancesz() -> list[dict[str, Any]]:
        return views.instancesz(view.snapshot())

    @app.get("/debug/configz")
    async def configz() -> list[Mapping[str, Any]]:
        return views.configz(view.objects())

    @app.get("/debug/adsz")
    async def adsz() -> dict[str, Any]:
        return await view.ask(Question("adsz"))  # type: ignore[no-any-return]

    @app.get("/debug/connections")
    async def connections() -> dict[str, Any]:
        return await view.ask(Question("connections"))  # type: ignore[no-any-return]

    @app.get("/debug/syncz")
    async def syncz() -> list[dict[str, Any]]:
        return await view.ask(Question("syncz"))  # type: ignore[no-any-return]

    @app.get("/debug/push_status")
    async def push_status() -> dict[str, Any]:
        status = await view.ask(Question("push_status"))
        if status is None:
            raise HTTPException(404, "no push has happened yet")
        return views.push_status_json(status)

    @app.get("/debug/config_dump")
    async def config_dump_endpoint(proxyID: str | None = None) -> dict[str, Any]:  # noqa: N803 - istiod's name
        return await _of_proxy(view, "config_dump", proxyID)

    @app.get("/debug/sync_diff")
    async def sync_diff_endpoint(proxyID: str | None = None) -> dict[str, Any]:  # noqa: N803
        return await _of_proxy(view, "sync_diff", proxyID)

    if monitoring:
        @app.get("/metrics")
        async def prometheus_metrics() -> Response:
            others = (await view.answers(Question("metrics")))[1:]  # this process's are in its registry
            return Response(metrics.exposition(others=others), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/version")
        async def version() -> dict[str, str]:
            return {"version": __version__, "python_version": platform.python_version()}

    return app


async def _of_proxy(view: DebugView, kind: Literal["config_dump", "sync_diff"], proxy_id: str | None) -> dict[str, Any]:
    """About the connection a `proxyID` query names; 400 or 404 with the reason when there is none."""
    if not proxy_id:
        raise HTTPException(400, "you must provide a proxyID in the query string")
    found = await view.ask(Question(kind, proxy_id))
    if found is None:
        raise HTTPException(404, f"proxy {proxy_id!r} is not connected to this istiod")
    return found  # type: ignore[no-any-return]


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"error": reason}, status_code=status)


def _index_page(monitoring: bool) -> str:
    entries = {**DEBUG_ENDPOINTS, **PROBES, **(MONITORING if monitoring else {})}
    rows = "\n".join(
        f'<tr><td><a href="{html.escape(path)}">{html.escape(path)}</a></td><td>{html.escape(text)}</td></tr>'
        for path, text in entries.items()
    )
    return (
        "<!doctype html><html><head><meta charset=utf-8><title>istiod debug</title></head><body>"
        f"<h1>istiod debug</h1><table>{rows}</table></body></html>"
    )

"""The node agent's endpoint for the CNI plugin: HTTP on a Unix socket (istio-cni's
`pluginevent.sock`), `POST /cmdadd` and `POST /cmddel` with Istio's event fields (`Netns`,
`PodName`, `PodNamespace`). 200 when done (or when the pod is not ambient), 400 naming what is wrong
with the request, 500 with the reason a capture failed: the plugin fails the ADD with it."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from istiod.cni.agent import CaptureError, NodeAgent

log = logging.getLogger(__name__)
EVENT_SOCKET = "pluginevent.sock"


class BadEvent(ValueError):
    pass


def _event(body: bytes, fields: tuple[str, ...]) -> dict[str, str]:
    try:
        event: Any = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadEvent(f"body is not JSON: {error}") from None
    if not isinstance(event, dict):
        raise BadEvent("body is not a JSON object")
    missing = [f for f in fields if not isinstance(event.get(f), str) or not event[f]]
    if missing:
        raise BadEvent(f"missing or not a string: {', '.join(missing)}")
    return {f: event[f] for f in fields}


def app(agent: NodeAgent) -> web.Application:
    async def cmdadd(request: web.Request) -> web.Response:
        try:
            event = _event(await request.read(), ("Netns", "PodName", "PodNamespace"))
        except BadEvent as error:
            return web.Response(status=400, text=f"cmdadd: {error}")
        try:
            captured = await agent.cni_add(event["PodNamespace"], event["PodName"], event["Netns"])
        except CaptureError as error:
            return web.Response(status=500, text=str(error))
        return web.json_response({"captured": captured})

    async def cmddel(request: web.Request) -> web.Response:
        try:
            event = _event(await request.read(), ("PodName", "PodNamespace"))
        except BadEvent as error:
            return web.Response(status=400, text=f"cmddel: {error}")
        return web.json_response({"released": await agent.cni_del(event["PodNamespace"], event["PodName"])})

    application = web.Application(client_max_size=64 << 10)
    application.router.add_post("/cmdadd", cmdadd)
    application.router.add_post("/cmddel", cmddel)
    return application


async def serve(agent: NodeAgent, path: Path) -> web.AppRunner:
    """Start serving on `path` (a stale socket file is replaced); the caller cleans the runner up."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    runner = web.AppRunner(app(agent), access_log=None)
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    log.info("CNI plugin events: serving on %s", path)
    return runner

"""Background tasks never stop quietly: istiod in-process, with a fault put into one of its tasks.
A task that may be restarted is, with backoff, and catches up; one that may not makes istiod
not-ready and exit non-zero."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc

from istiod.ca.settings import CaSettings
from istiod.server import Discovery, run_discovery
from istiod.settings import Address, Settings
from istiod.xds import pusher
from tests.conftest import render
from tests.peers import eventually


def settings(tmp_path: Path, mesh_dir: Path) -> Settings:
    loopback = Address("127.0.0.1", 0)
    return Settings(config_dir=mesh_dir, grpc_addr=loopback, http_addr=loopback, monitoring_addr=loopback,
                    secure_grpc_addr=loopback, webhook_addr=loopback, debounce_after=0.01, poll_interval=0.05,
                    ports_file=tmp_path / "ports.json", ca=CaSettings(state_dir=tmp_path / "state"))


@pytest.fixture
async def discovery(tmp_path: Path, mesh_dir: Path) -> AsyncIterator[Discovery]:
    running = Discovery(settings(tmp_path, mesh_dir))
    try:
        await running.start()
        await asyncio.wait_for(running.wait_synced(), 10)
        yield running
    finally:
        await running.stop()


async def test_a_crashed_pusher_is_restarted_and_catches_up(
    discovery: Discovery, mesh_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real, calls = pusher.build_snapshot, []

    def crash_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault in the snapshot build")
        return real(*args, **kwargs)

    monkeypatch.setattr(pusher, "build_snapshot", crash_once)
    (mesh_dir / "web.yaml").write_text(render("service.yaml", name="web", namespace="app", port=7070))
    await eventually(lambda: "web.app.svc.cluster.local" in discovery.pusher.snapshot.services, 10,
                     "the Service in a snapshot after the pusher's restart")
    restarts = [r.getMessage() for r in caplog.records if "restarting" in r.getMessage()]
    print(restarts)
    assert any("task=pusher" in m and "injected fault" in m for m in restarts)
    assert discovery.not_ready() is None


async def test_a_server_that_ends_makes_istiod_not_ready_and_exit_1(
    tmp_path: Path, mesh_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The monitoring port's server dies (as on an unexpected error): it cannot be restarted on its socket."""
    serve = uvicorn.Server.serve

    async def serving() -> bool:
        return await health_status(tmp_path) == health_pb2.HealthCheckResponse.SERVING

    async def dies(self: uvicorn.Server, sockets: Any = None) -> None:
        if sockets[0].getsockname()[1] != json.loads((tmp_path / "ports.json").read_text())["monitoring"]:
            return await serve(self, sockets)
        # Fails once istiod serves, so that it is this failure that takes istiod down.
        await eventually(serving, 30, "istiod to report SERVING on gRPC health")
        raise OSError("injected accept failure")

    monkeypatch.setattr(uvicorn.Server, "serve", dies)
    code = await asyncio.wait_for(run_discovery(settings(tmp_path, mesh_dir)), 60)
    print("exit code", code, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR])
    assert code == 1
    assert any("task=monitoring" in r.getMessage() and "istiod is not ready and exits" in r.getMessage()
               for r in caplog.records)


async def health_status(tmp_path: Path) -> int:
    port = json.loads((tmp_path / "ports.json").read_text())["grpc"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status

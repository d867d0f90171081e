"""The agent's Envoy supervision with a real process that always fails at once (/bin/false standing in
for a broken Envoy): restarts with backoff, then gives up."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from istiod.agent import envoy
from istiod.agent.admin import EnvoyAdmin
from istiod.agent.envoy import EnvoyOptions, EnvoySupervisor
from istiod.backoff import Backoff


async def test_an_envoy_that_keeps_failing_is_given_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(envoy, "RESTART_BACKOFF", Backoff(initial=0.01, cap=0.05))
    supervisor = EnvoySupervisor(EnvoyOptions(Path("/bin/false"), tmp_path / "bootstrap.json", tmp_path),
                                 EnvoyAdmin(("127.0.0.1", 1)))
    assert await asyncio.wait_for(supervisor.run(), 30) == 1
    assert supervisor.starts == envoy.MAX_QUICK_RESTARTS + 1
    assert "Envoy exited 11 times in a row, each soon after its start (the last with code 1); giving up" in caplog.text
    assert caplog.text.count("exited with code 1; restarting in") == envoy.MAX_QUICK_RESTARTS

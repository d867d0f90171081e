"""Background tasks that never stop quietly.

Every long-running task of istiod runs under the supervisor. A crash (or a return: these tasks run
until cancelled) is logged with its reason; a task whose restart is safe is restarted with backoff,
and any other marks the supervisor failed, so istiod goes not-ready and exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from istiod import logs
from istiod.backoff import Backoff

log = logging.getLogger(__name__)
RESTART = Backoff(initial=1.0, cap=30.0)
STABLE = 60.0  # a run that lasted this long starts the backoff again from its first step


class Supervisor:
    def __init__(self) -> None:
        self.failed = asyncio.Event()
        self.failure: str | None = None  # what stopped istiod, once `failed` is set
        self.stopping = False  # set on shutdown: tasks that end then are not failures

    def start(self, name: str, run: Callable[[], Awaitable[None]], restart: bool) -> asyncio.Task[None]:
        """Run `run()` as task `name`; `restart` says whether a fresh `run()` may take over after a crash."""
        return asyncio.create_task(self._supervise(name, run, restart), name=name)

    async def _supervise(self, name: str, run: Callable[[], Awaitable[None]], restart: bool) -> None:
        attempt = 0
        while True:
            started = time.monotonic()
            crash: Exception | None = None
            try:
                await run()
            except Exception as error:
                crash = error
            if self.stopping:
                return
            reason = f"crashed: {type(crash).__name__}: {crash}" if crash else "stopped"
            if not restart:
                self.failure = f"background task {name} {reason}"
                log.error(logs.event("background task ended; istiod is not ready and exits", task=name, reason=reason),
                          exc_info=crash)
                self.failed.set()
                return
            if time.monotonic() - started >= STABLE:
                attempt = 0
            delay = RESTART.delay(attempt)
            attempt += 1
            log.error(logs.event("background task ended; restarting", task=name, reason=reason, retry_in=round(delay, 1)),
                      exc_info=crash)
            await asyncio.sleep(delay)

"""Memory a burst freed goes back to the system (istiod.memory), not only back to malloc."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
import weakref

import pytest

from istiod import memory

pytestmark = pytest.mark.skipif(memory.free_bytes() is None, reason="malloc_trim is glibc's")


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_freed_chunks_are_returned_once_past_the_threshold() -> None:
    # Small chunks, as freed responses and connections are: malloc keeps them below live ones.
    burst = [bytearray(2000) for _ in range(40_000)]
    keep = [bytearray(2000) for _ in range(100)]  # live chunks above them, so freeing alone does not shrink the heap
    before = _rss()
    del burst
    assert _rss() > before - (40 << 20)  # still resident: freed to malloc only
    trimmer = asyncio.create_task(memory.trim_when_free(interval=0.05, threshold=16 << 20))
    try:
        async with asyncio.timeout(10):
            while _rss() > before - (40 << 20):
                await asyncio.sleep(0.05)
    finally:
        trimmer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await trimmer
    assert keep


class _CountedTrims:
    """memory.trim counting its calls while in use."""

    def __init__(self) -> None:
        self.count = 0
        self._real = memory.trim

    def __call__(self) -> int:
        self.count += 1
        return self._real()

    def __enter__(self) -> _CountedTrims:
        memory.trim = self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        memory.trim = self._real  # type: ignore[assignment]


async def test_no_trim_while_little_is_free() -> None:
    with _CountedTrims() as trims:
        memory.trim()  # what is free now is the baseline
        # quiet=0: never at rest, so only the counters could trim
        trimmer = asyncio.create_task(memory.trim_when_free(interval=0.02, threshold=1 << 30, quiet=0))
        await asyncio.sleep(0.2)
        trimmer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await trimmer
    assert trims.count == 1


class _Cyclic:
    def __init__(self) -> None:
        self.me = self
        self.payload = bytearray(8 << 20)


async def test_at_rest_after_work_cycles_are_collected_and_memory_trimmed() -> None:
    # A cycle that the generational thresholds leave alone (collection off here, as rare in istiod).
    gc.disable()
    with _CountedTrims() as trims:
        trimmer = asyncio.create_task(memory.trim_when_free(interval=0.1, threshold=1 << 30, quiet=0.5))
        try:
            await asyncio.sleep(0)  # the trimmer starts counting CPU from here
            garbage = _Cyclic()
            dead = weakref.ref(garbage)
            del garbage
            deadline = time.process_time() + 0.3
            while time.process_time() < deadline:  # work: the loop sees the process busy
                pass
            async with asyncio.timeout(10):
                while dead() is not None or not trims.count:
                    await asyncio.sleep(0.05)
            settled = trims.count
            await asyncio.sleep(0.5)  # still at rest: no trim again until there was work
            assert trims.count == settled
        finally:
            trimmer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await trimmer
            gc.enable()

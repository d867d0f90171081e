"""Memory a burst of work freed, given back to the system once it is free.

glibc's malloc keeps what is freed for reuse: after a push of the whole config to hundreds of Envoys
or a connect storm, the responses gRPC copied and the connections that left are free but still
resident, in the main heap below live chunks and in the arenas of gRPC's threads, so RSS stayed at
the burst's peak (bench/load.py, 500 Envoy-like clients: 281 MB at rest after the run, 181 MB after
malloc_trim). Istio's istiod, in Go, has its runtime's scavenger do this.

Every few seconds the free bytes malloc holds are read (mallinfo2, a sum over its arenas' counters);
past a threshold, malloc_trim(0) returns their whole free pages, in a thread (it locks one arena at
a time, as a malloc does). Without glibc (musl, macOS) there is nothing to do.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time

from istiod import logs

log = logging.getLogger(__name__)

INTERVAL = 5.0  # seconds between looks
THRESHOLD = 32 << 20  # free bytes held by malloc worth a trim


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError, TypeError):
        return None
    return libc


_LIBC = _libc()


def free_bytes() -> int | None:
    """Bytes malloc holds free (None without glibc)."""
    return None if _LIBC is None else int(_LIBC.mallinfo2().fordblks)


def trim() -> int:
    """Return malloc's free pages to the system; the free bytes it held before, 0 without glibc."""
    if _LIBC is None:
        return 0
    held = free_bytes() or 0
    _LIBC.malloc_trim(0)
    return held


async def trim_when_free(interval: float = INTERVAL, threshold: int = THRESHOLD) -> None:
    """Runs until cancelled: trims whenever malloc holds `threshold` more free bytes than after the
    last trim (free chunks between live ones stay counted once their pages are returned)."""
    if _LIBC is None:
        return
    after = 0
    while True:
        await asyncio.sleep(interval)
        free = free_bytes() or 0
        after = min(after, free)  # reused meanwhile
        if free - after < threshold:
            continue
        started = time.perf_counter()
        held = await asyncio.to_thread(trim)
        after = free_bytes() or 0
        log.debug(logs.event("malloc trim", free_mb=round(held / 2**20), ms=round((time.perf_counter() - started) * 1e3, 1)))

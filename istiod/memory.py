"""Memory a burst of work freed, given back to the system once it is free.

glibc's malloc keeps what is freed for reuse: after a push of the whole config to hundreds of Envoys
or a connect storm, the responses gRPC copied and the connections that left are free but still
resident, in the main heap below live chunks and in the arenas of gRPC's threads, so RSS stayed at
the burst's peak (bench/load.py, 500 Envoy-like clients: 281 MB at rest after the run, 181 MB after
malloc_trim). Istio's istiod, in Go, has its runtime's scavenger do this.

Every few seconds the free bytes malloc holds (mallinfo2, a sum over its arenas' counters) and the
process's RSS are read; once either has grown by a threshold since the last trim, malloc_trim(0)
returns the whole free pages, in a thread (it locks one arena at a time, as a malloc does). Both are
needed: memory reused and freed again between two looks (endpoint churn) leaves the free count where
it was while its pages are resident again.

Once the process goes quiet after work, one full garbage collection comes first, then a trim
whatever the counters say. istiod collects cycles rarely (server.py's thresholds, for pushes to
thousands of connections), and some pushes leave their frames in cycles (a stream that closed under
way): a load bench's 500 Envoys left up to 2000 copies of an Envoy's endpoint table (80 MB) to the
next full collection, minutes later, or never at rest. Without glibc (musl, macOS) there is nothing
to do.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import time

from istiod import logs

log = logging.getLogger(__name__)

INTERVAL = 5.0  # seconds between looks
THRESHOLD = 32 << 20  # free bytes held by malloc, or RSS grown, worth a trim
QUIET = 0.1  # below this share of a core between two looks the process is at rest


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


def settle_heap() -> None:
    """Once the mesh as first synced is built (in istiod and in each xDS worker): it mostly lives as
    long as the process, so out of the cyclic GC's reach the full collections that a connect storm's
    growth triggers do not walk it again and again (bench/connect.py: GC during a storm of 2000 from
    1.0 to 0.6 s CPU). Collections then come rarer than Python's default (700, 10, 10): a push to
    thousands of connections allocates far more than 700 objects, live across the clients' round
    trips, so each was walked again and again; and under endpoint churn, which makes no cyclic garbage,
    a full collection of 0.2 s (2000 connections) ran every 12 s. A load bench (bench/load.py, N=2000):
    GC CPU 3.1 -> 0.6 s."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


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


def resident() -> int:
    """The process's RSS in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def trim_when_free(interval: float = INTERVAL, threshold: int = THRESHOLD, quiet: float = QUIET) -> None:
    """Runs until cancelled: trims whenever malloc holds `threshold` more free bytes than after the
    last trim (free chunks between live ones stay counted once their pages are returned) or RSS has
    grown that much since, and (after a full collection) when the process goes quiet after work."""
    if _LIBC is None:
        return
    free_after, rss_after = 0, resident()
    cpu, worked = time.process_time(), False
    while True:
        await asyncio.sleep(interval)
        used, cpu = time.process_time() - cpu, time.process_time()
        busy = used >= interval * quiet
        at_rest, worked = worked and not busy, busy
        if at_rest:
            gc.collect()
        free, rss = free_bytes() or 0, resident()
        free_after, rss_after = min(free_after, free), min(rss_after, rss)  # reused meanwhile / returned
        if not at_rest and free - free_after < threshold and rss - rss_after < threshold:
            continue
        started = time.perf_counter()
        held = await asyncio.to_thread(trim)
        free_after, rss_after = free_bytes() or 0, resident()
        cpu = time.process_time()  # the collection and the trim are not work that makes the next look busy
        log.debug(logs.event("malloc trim", free_mb=round(held / 2**20), rss_mb=round(rss_after / 2**20),
                             at_rest=at_rest, ms=round((time.perf_counter() - started) * 1e3, 1)))

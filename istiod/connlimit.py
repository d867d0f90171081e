"""A cap on the connections one listening port holds, so idle sockets cannot use up the fds.

At the cap a new connection takes the place of the one that has waited longest without starting a
request (an idle socket, a slowloris, a TLS handshake that never ends); if every connection is busy,
the new one is refused. So a flood of idle sockets never locks real clients out.

The caps are sized from the process's open files limit (raised to the hard limit at start, as Go
programs do), so that every port at its cap still leaves fds for the others and for everything else:
a cap above the limit would let idle sockets starve the listening ports (accept fails with EMFILE).
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable, Hashable

from istiod import logs

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 4096  # a port's cap by default (istiod's --max-connections; the agent's status ports)
HTTP_READ_TIMEOUT = 30.0  # an HTTP request must arrive within this (istiod's --http-read-timeout; the agent's)
# The most connections an HTTP port accepts at once, before its cap sees them (asyncio accepts up to its
# listen backlog in one go; uvicorn's default of 2048 would take every fd a flood offers before the
# cap could close an idle one, and each accept that fails logs a traceback).
ACCEPT_BATCH = 64
# Fds kept out of the caps' reach: what the ports accept at once (three HTTP ports' batches, 15012's
# asyncio default of 100), files, clients of the Kubernetes API, Envoy's and the workers' pipes.
RESERVED_FDS = 3 * ACCEPT_BATCH + 100 + 128
# A connection without a call under way (none yet, or none since its last ended) is closed after this,
# on the xDS ports; a port's TLS handshake and first bytes must come within HANDSHAKE_TIMEOUT.
IDLE_TIMEOUT = 10.0
HANDSHAKE_TIMEOUT = 10.0


def raise_open_file_limit() -> int:
    """As Go programs (istiod, pilot-agent) do at start: the soft limit on open files up to the hard one,
    so a low default soft limit (often 1024) is not what caps the connections a process can hold.
    Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError) as error:
            log.warning(logs.event("cannot raise the open files limit", soft=soft, hard=hard, error=str(error)))
    return soft


def sized_cap(requested: int, fds_per_connection: int, flag: str = "") -> int:
    """`requested` connections a port, lowered so that every capped port at its cap,
    `fds_per_connection` fds for one more connection on each, fits in the open files limit with
    RESERVED_FDS to spare; logged, as a warning when `flag` asked for more."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    fits = max(1, (limit - RESERVED_FDS) // fds_per_connection)
    if requested > fits:
        (log.warning if flag else log.info)(logs.event(
            "connection cap lowered to fit the open files limit", flag=flag or "default", requested=requested,
            cap=fits, open_files_limit=limit))
        return fits
    return requested


class ConnectionCap:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[Hashable, Callable[[], None]] = {}  # connection -> how to close it
        self._idle: dict[Hashable, None] = {}  # in the order they became idle

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, connection: Hashable, close: Callable[[], None]) -> bool:
        """Whether `connection` may stay; it counts as idle until `busy`."""
        if len(self._open) >= self.limit:
            if not self._idle:
                return False
            oldest = next(iter(self._idle))
            evict = self._open[oldest]
            self.release(oldest)
            evict()
        self._open[connection] = close
        self._idle[connection] = None
        return True

    def busy(self, connection: Hashable) -> None:
        self._idle.pop(connection, None)

    def idle(self, connection: Hashable) -> None:
        if connection in self._open:
            self._idle.pop(connection, None)
            self._idle[connection] = None

    def release(self, connection: Hashable) -> None:
        self._idle.pop(connection, None)
        self._open.pop(connection, None)

"""A cap on the connections one listening port holds, so idle sockets cannot use up the fds.

At the cap a new connection takes the place of the one that has waited longest without starting a
request (an idle socket, a slowloris, a TLS handshake that never ends); if every connection is busy,
the new one is refused. So a flood of idle sockets never locks real clients out.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable


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

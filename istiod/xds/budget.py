"""A budget of bytes shared by every ADS stream's writes: how much of the responses is in gRPC's send
buffers at once, all streams together.

gRPC completes a write only once the client's flow control has taken it, so when a change reached
every Envoy at once (a new Service: each sent ~1000 clusters and their assignments, ~200 kB a
response) every stream's responses sat in the send buffers together, twice (the bytes given to gRPC
and its copy): with 500 Envoy-like clients the server's RSS went from ~400 to 796 MB. Writes beyond
the budget wait their turn, first come first served; the wait does not count against the send timeout.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ByteBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, size: int) -> int:
        """Takes `size` bytes of the budget (all of it, for a write larger than the budget), waiting for
        them if need be; returns what to give back to release() once the write is done."""
        size = min(size, self.limit)
        if not self._waiting and self.used + size <= self.limit:
            self.used += size
            return size
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append((size, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(size)  # granted as it was cancelled
            elif (size, waiter) in self._waiting:
                self._waiting.remove((size, waiter))
                self._grant()  # it may have been the head the others waited behind
            raise
        return size

    def release(self, size: int) -> None:
        self.used -= size
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.used + self._waiting[0][0] <= self.limit:
            size, waiter = self._waiting.popleft()
            if not waiter.cancelled():  # else its task, cancelled, has yet to run its except clause
                self.used += size
                waiter.set_result(None)

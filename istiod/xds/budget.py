"""A budget of bytes shared by every ADS stream's writes: how much of the responses is in gRPC's send
buffers at once, all streams together.

gRPC completes a write only once the client's flow control has taken it, so when a change reached
every Envoy at once (a new Service: each sent ~1000 clusters and their assignments, ~200 kB a
response) every stream's responses sat in the send buffers together, twice (the bytes given to gRPC
and its copy): with 500 Envoy-like clients the server's RSS went from ~400 to 796 MB. Writes beyond
the budget wait their turn, first come first served; the wait does not count against the send timeout.

The budget is shared fairly, so that clients that do not read cannot hold it against the others:
- A connection (an HTTP/2 connection: all its streams together) holds at most `share` of it; its
  writes beyond that wait behind each other without holding back other connections' writes.
- A write that has not finished within `stall` (its client does not read) loses its claim on the
  budget: it stops counting against the others, though still against its own connection's share
  until it finishes or its stream is closed (by the send deadline). So stalled streams on many
  connections free the budget within `stall`, and each connection still keeps at most `share` of
  responses in the send buffers.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

SHARE = 8  # a connection's share: 1/8 of the budget (4 MB of istiod's 32)
STALL = 1.0  # seconds after which a write still under way loses its claim on the budget


@dataclass(eq=False, slots=True)
class Claim:
    """Bytes of the budget held by one write; give it back to release() once the write is done."""

    size: int
    owner: Hashable
    at: float = 0.0  # when it was granted (the loop's clock)
    counted: bool = True  # against the whole budget (False once stalled); always against its owner's share


@dataclass(eq=False, slots=True)
class _Waiter:
    claim: Claim
    future: asyncio.Future[None]
    number: int  # arrival order
    in_line: bool = False
    gone: bool = False  # cancelled while queued


@dataclass(slots=True)
class _Owner:
    used: int = 0
    waiting: deque[_Waiter] = field(default_factory=deque)


class ByteBudget:
    def __init__(self, limit: int, share: int | None = None, stall: float = STALL) -> None:
        self.limit = limit
        self.share = min(limit, share or max(1, limit // SHARE))
        self.stall = stall
        self.used = 0
        self._owners: dict[Hashable, _Owner] = {}
        # The first waiter of each owner whose share has room for it, by arrival: the line for the budget.
        self._line: list[tuple[int, _Waiter]] = []
        self._held: dict[Claim, None] = {}  # counted claims, oldest first
        self._numbers = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    def owner_used(self, owner: Hashable) -> int:
        owned = self._owners.get(owner)
        return owned.used if owned is not None else 0

    async def acquire(self, size: int, owner: Hashable = None) -> Claim:
        """Takes `size` bytes (at most a share: a larger write goes alone) for a write of `owner`'s,
        waiting for them if need be."""
        loop = asyncio.get_running_loop()
        claim = Claim(min(size, self.share), owner)
        owned = self._owners.setdefault(owner, _Owner())
        if not self._line and not owned.waiting and self._fits(claim, owned):
            self._take(claim, owned, loop.time())
            return claim
        waiter = _Waiter(claim, loop.create_future(), next(self._numbers))
        owned.waiting.append(waiter)
        self._queue_next(owned)
        self._grant()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(claim)  # granted as it was cancelled
            else:
                self._leave(waiter, owned)
            raise
        return claim

    def release(self, claim: Claim) -> None:
        if claim.counted:
            self.used -= claim.size
            del self._held[claim]
        owned = self._owners[claim.owner]
        owned.used -= claim.size
        if not owned.used and not owned.waiting:
            del self._owners[claim.owner]
        else:
            self._queue_next(owned)
        self._grant()

    def _fits(self, claim: Claim, owned: _Owner) -> bool:
        return self.used + claim.size <= self.limit and owned.used + claim.size <= self.share

    def _take(self, claim: Claim, owned: _Owner, now: float) -> None:
        claim.at = now
        self.used += claim.size
        owned.used += claim.size
        self._held[claim] = None

    def _queue_next(self, owned: _Owner) -> None:
        """Puts the owner's first waiter in line for the budget once its share has room for it."""
        if owned.waiting:
            first = owned.waiting[0]
            if owned.used + first.claim.size <= self.share and not first.in_line:
                first.in_line = True
                heapq.heappush(self._line, (first.number, first))

    def _leave(self, waiter: _Waiter, owned: _Owner) -> None:
        first = owned.waiting[0] is waiter
        owned.waiting.remove(waiter)
        waiter.gone = True  # its place in line, if it had one, is skipped
        if not owned.used and not owned.waiting:
            del self._owners[waiter.claim.owner]
        elif first:
            self._queue_next(owned)
        self._grant()  # it may have been the one the others waited behind

    def _grant(self) -> None:
        loop = asyncio.get_running_loop()
        while self._line:
            _, waiter = self._line[0]
            if waiter.gone or waiter.future.cancelled():  # a cancelled one leaves in its task's except clause
                heapq.heappop(self._line)
                continue
            if self.used + waiter.claim.size > self.limit:
                self._watch_stalls(loop)
                return
            heapq.heappop(self._line)
            owned = self._owners[waiter.claim.owner]
            owned.waiting.popleft()
            self._take(waiter.claim, owned, loop.time())
            waiter.future.set_result(None)
            self._queue_next(owned)

    def _watch_stalls(self, loop: asyncio.AbstractEventLoop) -> None:
        """The line waits for the budget: one timer for the oldest claim's stall (not one per write)."""
        if self._timer is None and self._held:
            oldest = next(iter(self._held))
            self._timer = loop.call_at(oldest.at + self.stall, self._stalled)

    def _stalled(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time()
        for claim in list(self._held):
            if now - claim.at < self.stall:
                break
            claim.counted = False
            self.used -= claim.size
            del self._held[claim]
        self._grant()

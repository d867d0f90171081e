"""Admission of new xDS streams: gRPC core's own backlog limits off, istiod's request rate limit instead.

grpcio's asyncio server takes calls from gRPC core one at a time on the event loop; in a connect
storm the rest wait in core's pending queue, and core drops calls at random once more than
`grpc.server.max_pending_requests` (1000) wait, all past the hard limit (3000), and any that wait
30 s: the client sees a bare CANCELLED (or INTERNAL when its next send fails), and nothing is logged.
So core queues every call here, and the stream handler admits them at a rate (istiod's
PILOT_MAX_REQUESTS_PER_SECOND): a stream that cannot get a token within a second is refused with
RESOURCE_EXHAUSTED and a message, so the client backs off and retries or goes to another replica.
"""

from __future__ import annotations

import asyncio
import time

_INT_MAX = 2**31 - 1  # gRPC core's integer channel arguments
# Options for every grpc.aio.server that serves ADS: core keeps all calls until the handler sees them.
CORE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_concurrent_streams", 1 << 20),
    ("grpc.server.max_pending_requests", _INT_MAX),
    ("grpc.server.max_pending_requests_hard_limit", _INT_MAX),
    ("grpc.server_max_unrequested_time_in_server", _INT_MAX),
    # No BDP probing: a stream's receive window stays at HTTP/2's 64 kB instead of growing, so requests
    # that arrive faster than they are handled (500 Envoy-like clients ACKing each push with every cluster
    # named) wait in the clients, not in core's buffers: churn RSS ~400 -> ~330 MB, peak 416 -> 372 MB.
    ("grpc.http2.bdp_probe", 0),
]
MAX_WAIT = 1.0  # istiod: "give a bit of time for queue to clear out, but if not fail fast"
# istiod's default is min(15 + 5 x cores, 100), 25 a second on 2 cores: 80 s to admit 2000 proxies that
# reconnect at once. Here a new proxyless stream costs a few ms, and the event loop takes calls from
# core at a few hundred a second anyway; this bounds bursts without slowing a storm down.
DEFAULT_RATE = 1000.0


class RateLimited(Exception):
    """A new stream found no token within MAX_WAIT."""


class RequestLimiter:
    """A token bucket as Go's rate.Limiter (which istiod uses): `rate` tokens a second, `burst` at most.

    Waiters reserve tokens in arrival order; one whose token comes later than `max_wait` from now is
    refused at once, without waiting, as rate.Limiter.Wait refuses a wait past the context's deadline.
    """

    def __init__(self, rate: float, burst: int = 1, max_wait: float = MAX_WAIT) -> None:
        self.rate = rate  # 0: no limit (as rate.Limiter's Limit() == 0 in istiod)
        self.burst = burst
        self.max_wait = max_wait
        self._tokens = float(burst)
        self._at = time.monotonic()

    def reserve(self) -> float:
        """Takes a token; returns seconds to wait for it, or raises RateLimited (no token taken)."""
        if not self.rate:
            return 0.0
        now = time.monotonic()
        tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate) - 1
        wait = -tokens / self.rate if tokens < 0 else 0.0
        if wait > self.max_wait:
            raise RateLimited(f"request rate limit exceeded: more than {self.rate:g} new streams a second; "
                              f"retry later or connect to another replica")
        self._tokens, self._at = tokens, now
        return wait

    async def wait(self) -> None:
        if delay := self.reserve():
            await asyncio.sleep(delay)

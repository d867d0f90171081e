"""Exponential backoff with full jitter, for every retry loop (informers, the CA's writers, the agent)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    initial: float = 0.2
    cap: float = 30.0

    def delay(self, attempt: int) -> float:
        """Full jitter, so clients that failed together do not retry together."""
        return random.uniform(0, min(self.cap, self.initial * 2**attempt))

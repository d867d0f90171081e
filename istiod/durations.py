"""Durations in Go's grammar (`300ms`, `1m30s`, `2h45m`), as istiod's flags and environment spell them."""

from __future__ import annotations

import argparse
import math
import re

import durationpy

# Go's time.ParseDuration: a sign, then one or more decimal numbers each with a unit; a bare `0`
# is the only unitless value. durationpy also takes `d` and a sign per term; Go takes neither.
_GO_DURATION = re.compile(r"[-+]?(0|((\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h))+)")
_MAX_SECONDS = (2**63 - 1) / 1e9  # Go's time.Duration is int64 nanoseconds (about 2562047h)


def parse_duration(text: str) -> float:
    """A Go duration -> seconds; unitless, negative or out-of-range values are refused (an argparse type)."""
    if not _GO_DURATION.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"duration {text!r} must be a number with a unit, like 100ms, 1m30s or 24h")
    seconds = durationpy.from_str(text.strip()).total_seconds()
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"duration {text!r} must not be negative")
    if not math.isfinite(seconds) or seconds > _MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"duration {text!r} is longer than Go's longest, 2562047h")
    return seconds


def go_duration(seconds: float) -> str:
    """Whole seconds the way Go prints a time.Duration (`24h0m0s`, `1m30s`, `45s`), as Istio's messages do."""
    total = int(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"

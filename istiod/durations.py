"""Go-style durations, as istiod's flags and messages spell them."""

from __future__ import annotations

import argparse

_UNITS = (("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("h", 3600.0))


def parse_duration(text: str) -> float:
    """`100ms`, `1s`, `2m`, `24h` or plain seconds -> seconds (an argparse type)."""
    for suffix, scale in _UNITS:
        if text.endswith(suffix) and text[: -len(suffix)].replace(".", "", 1).isdigit():
            return float(text[: -len(suffix)]) * scale
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"duration {text!r} must look like 100ms, 1s, 2m or 24h") from None


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

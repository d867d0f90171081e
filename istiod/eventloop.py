"""The event loop istiod's serving processes run on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_fast(main: Coroutine[Any, Any, int]) -> int:
    """uvloop's event loop when it is installed (the `fast` extra): the ADS server spends much of its
    time in the loop's own socket and callback work."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def new_loop() -> asyncio.AbstractEventLoop:
    """An event loop for a thread of its own: uvloop's when installed, as run_fast's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()

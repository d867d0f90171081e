"""`istiod version`: this istiod's version, and with --remote the running one's (from /version)."""

from __future__ import annotations

import sys

from istiod import __version__
from istiod.tools.debug_client import DebugClient


def run(remote: DebugClient | None, short: bool) -> int:
    if remote is None:
        sys.stdout.write(f"{__version__}\n" if short else f"client version: {__version__}\n")
        return 0
    server = remote.get("/version").get("version", "unknown")
    sys.stdout.write(f"{__version__}\n{server}\n" if short
                     else f"client version: {__version__}\ncontrol plane version: {server}\n")
    return 0

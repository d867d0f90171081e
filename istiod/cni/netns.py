"""Finding a pod's network namespace when the CNI plugin did not name it (pods that ran before the
agent, or before their namespace joined the mesh): the namespace files under a directory
(`ip netns`'s /var/run/netns by default) whose interfaces carry the pod's IP."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)
_INET = re.compile(r"\binet (\d+\.\d+\.\d+\.\d+)/")


class NetnsError(Exception):
    """No single network namespace could be named for a pod."""


async def addresses(netns: str) -> set[str]:
    """The IPv4 addresses inside a network namespace; empty if it cannot be entered."""
    process = await asyncio.create_subprocess_exec(
        "nsenter", f"--net={netns}", "ip", "-4", "-o", "addr", "show",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        out, _ = await asyncio.wait_for(process.communicate(), 10)
    except TimeoutError:
        process.kill()
        await process.wait()
        return set()
    return set(_INET.findall(out.decode())) if process.returncode == 0 else set()


async def find_by_ip(directory: Path, ip: str) -> str:
    """The one namespace file under `directory` holding `ip`; NetnsError when none or several do."""
    if not ip:
        raise NetnsError("the pod has no IP yet")
    try:
        candidates = sorted(str(p) for p in directory.iterdir() if not p.name.startswith("."))
    except OSError as error:
        raise NetnsError(f"cannot list {directory}: {error.strerror}") from None
    found = [path for path in candidates if ip in await addresses(path)]
    if not found:
        raise NetnsError(f"no network namespace under {directory} has {ip}")
    if len(found) > 1:  # capturing the wrong one would break another pod: refuse
        raise NetnsError(f"{ip} is in several network namespaces: {', '.join(found)}")
    return found[0]

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


class NetnsIndex:
    """Which namespace file under a directory holds which IP, read once (one `ip addr` per
    namespace) the first time it is asked, so one pass over many pods costs one scan."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._by_ip: dict[str, list[str]] | None = None
        self._problem = ""

    async def find(self, ip: str) -> str:
        """The one namespace holding `ip`; NetnsError when none or several do."""
        if not ip:
            raise NetnsError("the pod has no IP yet")
        if self._by_ip is None:
            self._by_ip = {}
            try:
                paths = sorted(str(p) for p in self.directory.iterdir() if not p.name.startswith("."))
            except OSError as error:
                paths, self._problem = [], f"cannot list {self.directory}: {error.strerror}"
            for path in paths:
                for address in await addresses(path):
                    self._by_ip.setdefault(address, []).append(path)
        if self._problem:
            raise NetnsError(self._problem)
        found = self._by_ip.get(ip, [])
        if not found:
            raise NetnsError(f"no network namespace under {self.directory} has {ip}")
        if len(found) > 1:  # capturing the wrong one would break another pod: refuse
            raise NetnsError(f"{ip} is in several network namespaces: {', '.join(found)}")
        return found[0]

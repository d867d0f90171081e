"""Network gateways named by hostname (a meshNetworks gateway `address`, a gateway Service's
LoadBalancer ingress `hostname`, as an AWS load balancer has), resolved as istiod's
networkGatewayNameCache does with RESOLVE_HOSTNAME_GATEWAYS: each name once it is first seen, then
again every 30 s (istiod refreshes at the DNS record's TTL, at least 30 s; the system resolver gives
no TTL, so always the minimum), A and AAAA records. A name that does not resolve keeps its last
addresses (none at first: that gateway is left out) and is logged, once per failure streak. A change
is handed to `on_change`, and istiod then pushes every proxy's EDS (the gateways are in the mesh
config, istiod/xds/gen/network.py). I/O at the edge; translation stays pure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Mapping

from istiod import logs
from istiod.model.snapshot import Snapshot
from istiod.xds.gen.network import gateway_hostnames

log = logging.getLogger(__name__)

REFRESH_INTERVAL = 30.0  # istiod's MinGatewayTTL
Addresses = Mapping[str, tuple[str, ...]]


class GatewayNameResolver:
    def __init__(self, on_change: Callable[[Addresses], None], refresh_interval: float = REFRESH_INTERVAL) -> None:
        self.on_change = on_change
        self.refresh_interval = refresh_interval
        self._names: frozenset[str] = frozenset()
        self._addresses: dict[str, tuple[str, ...]] = {}
        self._failing: set[str] = set()
        self._wake = asyncio.Event()

    def want(self, snapshot: Snapshot) -> None:
        """The names the snapshot's gateways use; new ones are resolved at once."""
        names = gateway_hostnames(snapshot)
        if names != self._names:
            self._names = names
            self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            await self.resolve()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.refresh_interval):
                    await self._wake.wait()

    async def resolve(self) -> None:
        found: dict[str, tuple[str, ...]] = {}
        for name in sorted(self._names):
            addresses = await self._lookup(name)
            if addresses is None:
                addresses = self._addresses.get(name, ())
            if addresses:
                found[name] = addresses
        if found != self._addresses:
            self._addresses = found
            log.info(logs.event("network gateway names resolved",
                                addresses=" ".join(f"{n}={','.join(a)}" for n, a in found.items()) or None))
            self.on_change(dict(found))

    async def _lookup(self, name: str) -> tuple[str, ...] | None:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError as error:  # socket.gaierror: no such name, no resolver
            if name not in self._failing:
                self._failing.add(name)
                log.warning(logs.event("network gateway name not resolved", hostname=name, error=str(error),
                                       kept=",".join(self._addresses.get(name, ())) or None))
            return None
        self._failing.discard(name)
        return tuple(sorted({str(info[4][0]) for info in infos}))

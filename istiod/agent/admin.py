"""Envoy's admin API as the agent calls it: on loopback TCP (Istio's 127.0.0.1:15000), or on a Unix
socket, which an agent outside the pod's network namespace can still reach."""

from __future__ import annotations

import asyncio
import http.client
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from istiod.model.names import join_host_port
from istiod.unixhttp import UnixHTTPConnection

TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class EnvoyAdmin:
    address: tuple[str, int] | Path

    def __str__(self) -> str:
        return f"unix:{self.address}" if isinstance(self.address, Path) else join_host_port(*self.address)

    def bootstrap_address(self) -> dict[str, Any]:
        if isinstance(self.address, Path):
            return {"pipe": {"path": str(self.address)}}
        return {"socket_address": {"address": self.address[0], "port_value": self.address[1]}}

    async def request(self, method: str, path: str) -> tuple[int, str]:
        """(status, body), off the event loop; OSError when Envoy does not answer."""
        return await asyncio.to_thread(self.call, method, path)

    def call(self, method: str, path: str) -> tuple[int, str]:
        connection = (UnixHTTPConnection(str(self.address), TIMEOUT) if isinstance(self.address, Path)
                      else http.client.HTTPConnection(*self.address, timeout=TIMEOUT))
        try:
            connection.request(method, path)
            reply = connection.getresponse()
            return reply.status, reply.read().decode()
        except http.client.HTTPException as error:
            raise OSError(f"bad answer from Envoy's admin: {error!r}") from None
        finally:
            connection.close()


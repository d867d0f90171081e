"""The agent's SDS server (pilot-agent's workload SDS on ./var/run/secrets/workload-spiffe-uds/socket).

Envoy opens one StreamSecrets per secret: `default` (the workload's key and certificate chain) and
`ROOTCA` (the mesh root, to validate peers). The key is made by the agent and handed only to Envoy
over this local socket. When the agent renews the certificate, every open stream gets the new secret
at once, so Envoy uses it for new connections without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, TypeAlias

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from google.protobuf import any_pb2

from istiod.ca.pki import key_pem
from istiod.xds.types import SECRET

if TYPE_CHECKING:
    from istiod.agent.agent import Issued

log = logging.getLogger(__name__)

WORKLOAD_SECRET = "default"
ROOT_SECRET = "ROOTCA"


def secret(name: str, issued: Issued) -> secret_pb2.Secret:
    """`default` or `ROOTCA` from the current certificate; ValueError for any other name."""
    if name == WORKLOAD_SECRET:
        return secret_pb2.Secret(name=name, tls_certificate=common_pb2.TlsCertificate(
            certificate_chain=base_pb2.DataSource(inline_bytes="".join(issued.chain[:-1]).encode()),
            private_key=base_pb2.DataSource(inline_bytes=key_pem(issued.key)),
        ))
    if name == ROOT_SECRET:
        return secret_pb2.Secret(name=name, validation_context=common_pb2.CertificateValidationContext(
            trusted_ca=base_pb2.DataSource(inline_bytes=issued.chain[-1].encode()),
        ))
    raise ValueError(f"unknown secret {name!r}: this agent serves {WORKLOAD_SECRET!r} and {ROOT_SECRET!r}")


_ROTATED, _CLOSED = "rotated", "closed"
_Event: TypeAlias = "discovery_pb2.DiscoveryRequest | str"


class SecretServer(sds_pb2_grpc.SecretDiscoveryServiceServicer):
    def __init__(self) -> None:
        self.issued: Issued | None = None  # Envoy starts only once there is one
        self._streams: set[asyncio.Queue[_Event]] = set()

    def update(self, issued: Issued) -> None:
        """A renewed certificate: pushed on every open stream."""
        self.issued = issued
        for stream in self._streams:
            stream.put_nowait(_ROTATED)

    async def StreamSecrets(
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        events: asyncio.Queue[_Event] = asyncio.Queue()
        reader = asyncio.create_task(_read(request_iterator, events))
        self._streams.add(events)
        names: tuple[str, ...] = ()
        sent = 0
        try:
            while (event := await events.get()) != _CLOSED:
                if isinstance(event, discovery_pb2.DiscoveryRequest):
                    if event.HasField("error_detail"):
                        log.error("SDS: Envoy rejected %s version %s: %s", ",".join(event.resource_names),
                                  event.version_info, event.error_detail.message)
                        continue
                    if event.response_nonce and tuple(event.resource_names) == names:
                        continue  # an ACK
                    names = tuple(event.resource_names)
                if not names or self.issued is None:
                    continue  # rotated before Envoy asked for anything
                issued = self.issued
                try:
                    resources = [secret(name, issued) for name in names]
                except ValueError as error:
                    log.error("SDS: %s", error)
                    await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
                sent += 1
                version = f"{issued.leaf.serial_number:x}"
                log.info("SDS: pushed %s serial=%s", ",".join(names), version)
                yield discovery_pb2.DiscoveryResponse(
                    version_info=version, type_url=SECRET, nonce=str(sent),
                    resources=[_pack(resource) for resource in resources],
                )
        finally:
            self._streams.discard(events)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


async def _read(requests: AsyncIterator[discovery_pb2.DiscoveryRequest], events: asyncio.Queue[_Event]) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for request in requests:
            events.put_nowait(request)
    events.put_nowait(_CLOSED)


def _pack(message: secret_pb2.Secret) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed

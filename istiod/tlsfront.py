"""TLS for istiod's secure port, terminated in front of a loopback gRPC server.

grpcio's server credentials either require a client certificate or never ask for one, but istiod's
secure port must take both: a workload's first CSR comes with only a token, while renewals and xDS
clients present a certificate from this CA (Go's VerifyClientCertIfGiven). So TLS is terminated
here with Python's ssl (client certificate optional, verified if given), the bytes are forwarded to
a plaintext gRPC server on loopback, and each forwarded connection's verified client certificate is
recorded under the peer name that inner server sees (`ipv4:127.0.0.1:<our source port>`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable

import grpc
from cryptography import x509

from istiod.ca.authenticate import Credentials

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT = 10.0


class TlsFront:
    def __init__(self, host: str, port: int, backend_port: int, context: Callable[[], ssl.SSLContext]) -> None:
        self.host, self.port = host, port
        self.backend_port = backend_port
        self.context = context
        self._peers: dict[str, x509.Certificate | None] = {}
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()

    def credentials(self, context: grpc.aio.ServicerContext) -> Credentials:
        """The caller's credentials as the inner gRPC server sees it (no certificate unless it came through TLS)."""
        metadata = {key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}
        return Credentials(metadata.get("authorization"), self._peers.get(context.peer() or ""))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            await self._forward(reader, writer)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = writer.get_extra_info("peername")
        try:
            await asyncio.wait_for(writer.start_tls(self.context()), HANDSHAKE_TIMEOUT)
        except (ssl.SSLError, OSError, asyncio.TimeoutError) as error:
            log.warning("TLS handshake with %s refused: %s", _address(client), _reason(error))
            return
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        cert = x509.load_der_x509_certificate(der) if der else None
        try:
            backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
        except OSError as error:
            log.error("secure port: inner gRPC server unreachable: %s", error)
            return
        peer = f"ipv4:127.0.0.1:{backend_writer.get_extra_info('sockname')[1]}"
        self._peers[peer] = cert  # before a byte is forwarded, so every RPC finds it
        try:
            pumps = [asyncio.create_task(_pump(reader, backend_writer)), asyncio.create_task(_pump(backend_reader, writer))]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
        finally:
            backend_writer.close()
            del self._peers[peer]


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await source.read(1 << 16):
            sink.write(data)
            await sink.drain()


def _address(peername: object) -> str:
    return f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)


def _reason(error: BaseException) -> str:
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"client certificate not accepted ({error.verify_message})"
    if isinstance(error, asyncio.TimeoutError):
        return f"no handshake within {HANDSHAKE_TIMEOUT:g}s"
    return str(error) or type(error).__name__

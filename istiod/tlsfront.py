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
from istiod.model.names import join_host_port

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT = 10.0


class TlsFront:
    def __init__(self, host: str, port: int, backend_port: int, context: Callable[[], ssl.SSLContext]) -> None:
        self.host, self.port = host, port
        self.backend_port = backend_port
        self.context = context
        self._peers: dict[str, x509.Certificate | None] = {}
        self._transports: set[asyncio.BaseTransport] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.get_running_loop().create_server(lambda: _Accepted(self), self.host, self.port)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for transport in list(self._transports):
            transport.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)

    def accept(self, transport: asyncio.Transport) -> None:
        task = asyncio.get_running_loop().create_task(self.serve(transport))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def credentials(self, context: grpc.aio.ServicerContext) -> Credentials:
        """The caller's credentials as the inner gRPC server sees it (no certificate unless it came through TLS)."""
        metadata = {key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}
        return Credentials(metadata.get("authorization"), self._peers.get(context.peer() or ""))

    async def serve(self, transport: asyncio.Transport) -> None:
        self._transports.add(transport)
        try:
            await self._forward(transport)
        finally:
            self._transports.discard(transport)
            transport.close()

    async def _forward(self, transport: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        client = transport.get_extra_info("peername")
        reader = asyncio.StreamReader()
        protocol = _TlsStreamProtocol(reader)
        try:
            tls = await asyncio.wait_for(
                loop.start_tls(transport, protocol, self.context(), server_side=True), HANDSHAKE_TIMEOUT
            )
        except (ssl.SSLError, OSError, asyncio.TimeoutError) as error:
            log.warning("TLS handshake with %s refused: %s", _address(client), _reason(error))
            return
        assert tls is not None
        self._transports.add(tls)
        writer = asyncio.StreamWriter(tls, protocol, reader, loop)
        der = tls.get_extra_info("ssl_object").getpeercert(binary_form=True)
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
            self._transports.discard(tls)
            tls.close()


class _TlsStreamProtocol(asyncio.StreamReaderProtocol):
    def eof_received(self) -> bool:
        super().eof_received()
        return False  # TLS has no half-close: the connection ends with the client's data


class _Accepted(asyncio.Protocol):
    """Holds a new connection still, so the TLS handshake sees its very first byte."""

    def __init__(self, front: TlsFront) -> None:
        self.front = front

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        # Bytes read before start_tls would be lost to it (a ClientHello vanishing, a stalled handshake).
        transport.pause_reading()
        self.front.accept(transport)


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await source.read(1 << 16):
            sink.write(data)
            await sink.drain()


def _address(peername: object) -> str:
    return join_host_port(peername[0], peername[1]) if isinstance(peername, tuple) else str(peername)


def _reason(error: BaseException) -> str:
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"client certificate not accepted ({error.verify_message})"
    if isinstance(error, asyncio.TimeoutError):
        return f"no handshake within {HANDSHAKE_TIMEOUT:g}s"
    return str(error) or type(error).__name__

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
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from typing import cast

import grpc
from cryptography import x509

from istiod import logs
from istiod.ca.authenticate import Credentials
from istiod.connlimit import HANDSHAKE_TIMEOUT, IDLE_TIMEOUT, MAX_CONNECTIONS, ConnectionCap
from istiod.eventloop import new_loop
from istiod.model.names import join_host_port

log = logging.getLogger(__name__)
_refusals = logs.Throttled(log)  # a client can cause these at will
# The TLS handshake and the client's first bytes (a gRPC client's HTTP/2 preface comes at once) must
# arrive within HANDSHAKE_TIMEOUT; after that the inner server's keepalive finds dead peers. A
# connection without a call under way (none yet: no credentials shown; or none since its last ended)
# is closed after IDLE_TIMEOUT: otherwise HTTP/2 connections that never open a stream, which keepalive
# keeps alive, fill --max-connections. A gRPC client reconnects when it next calls.
CLOSE_TIMEOUT = 2.0  # how long a closing connection may take to flush to a client before it is cut
# What the inner server sends is relayed this much at a time; a client's TLS transport holds at most
# twice that before the relay stops reading the inner server (see _InnerSide).
RELAY_CHUNK = 64 * 1024
_RELAY_BUFFER = memoryview(bytearray(RELAY_CHUNK))
# How long a thread that wants the GIL waits before the one holding it must let go (Python's default:
# 5 ms). ssl lets go of the GIL for each record it encrypts or decrypts, and the serving loop's thread,
# busy generating config, takes it back at once: the front then waited 5 ms per chunk it relayed,
# about 13 MB/s for all of a process's connections, and a connect storm's writes missed their send
# deadline. At 0.5 ms the front keeps up, at the cost of more frequent switches while both are busy.
SWITCH_INTERVAL = 0.0005


class TlsFront:
    def __init__(self, host: str, port: int, backend_port: int, context: Callable[[], ssl.SSLContext],
                 user_timeout: float = 10.0, max_connections: int = MAX_CONNECTIONS, reuse_port: bool = False) -> None:
        """`reuse_port`: join the SO_REUSEPORT group of the port (the xDS workers' fronts), the kernel
        spreading new connections among its members."""
        self.host, self.port = host, port
        self.reuse_port = reuse_port
        self.backend_port = backend_port
        self.context = context
        # gRPC core sets TCP_USER_TIMEOUT to the keepalive timeout on 15010's sockets: a peer that stops
        # acknowledging is dropped by the kernel. The same here, or it lingers behind the front.
        self.user_timeout = user_timeout
        self._cap = ConnectionCap(max_connections)
        self._peers: dict[str, x509.Certificate | None] = {}
        self._fronts: dict[str, asyncio.Transport] = {}  # the inner server's peer name -> the client's connection
        self._clients: dict[str, str] = {}  # the inner server's peer name -> the client's, as gRPC names peers
        self._calls: dict[asyncio.Transport, int] = {}  # calls under way per connection
        self._idle: dict[asyncio.Transport, asyncio.TimerHandle] = {}  # connections without a call, to close
        self._transports: set[asyncio.Transport] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def start(self) -> int:
        """Listens on a thread of its own, with an event loop of its own: the relayed bytes, and the HTTP/2
        flow control and keepalive they carry, then move while the serving loop is busy generating config
        (a loop busy for a few hundred ms held every window update as long, and streams missed their send
        deadline). Only the GIL is shared; ssl encrypts and decrypts without it."""
        self._loop = loop = new_loop()
        sys.setswitchinterval(SWITCH_INTERVAL)
        self._thread = threading.Thread(target=loop.run_forever, name="tls-front", daemon=True)
        self._thread.start()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._listen(), loop))

    async def _listen(self) -> int:
        # A burst of connections waits in the kernel's accept queue (capped by net.core.somaxconn), as
        # gRPC core's and Go's listeners let it: with asyncio's default of 100, the rest of a connect
        # storm had their SYNs dropped and retried 1, 3, 7 s later, late for the handshake deadline.
        self._server = await asyncio.get_running_loop().create_server(lambda: _Accepted(self), self.host, self.port,
                                                                      backlog=self._cap.limit,
                                                                      reuse_port=self.reuse_port or None)
        return self._server.sockets[0].getsockname()[1]

    def stop_accepting(self) -> None:
        if self._server is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._server.close)

    async def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self.stop_accepting()
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._close_all(), loop))
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join, 5)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None

    async def _close_all(self) -> None:
        for transport in list(self._transports):
            transport.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)

    def accept(self, transport: asyncio.Transport, early: bytearray) -> None:
        client = _address(transport.get_extra_info("peername"))
        if not self._cap.admit(transport, transport.abort):
            _refusals.warning(logs.event("secure port: connection refused, every connection busy",
                                         client=client, max_connections=self._cap.limit))
            transport.abort()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, round(self.user_timeout * 1000))
        self._went_idle(transport)
        task = asyncio.get_running_loop().create_task(self.serve(transport, client, early))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def credentials(self, context: grpc.aio.ServicerContext) -> Credentials:
        """The caller's credentials as the inner gRPC server sees it (no certificate unless it came through
        TLS). Every call asks once (the CA's and ADS's): its connection is busy until the call ends."""
        peer = context.peer() or ""
        transport, loop = self._fronts.get(peer), self._loop
        if transport is not None and loop is not None:  # the connection's state is the front's thread's
            loop.call_soon_threadsafe(self._call_started, transport)
            # The stubs type the callback as a class of their own; any callable taking the context does.
            context.add_done_callback(lambda _: loop.call_soon_threadsafe(self._call_ended, transport))  # type: ignore[arg-type]
        metadata = {key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}
        return Credentials(metadata.get("authorization"), self._peers.get(peer))

    def client(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's address (`ipv4:10.1.2.3:40312`), where the inner server sees the front's loopback
        connection: what logs and /debug/connections show, as istiod shows the proxy's own."""
        peer = context.peer() or ""
        return self._clients.get(peer, peer)

    def _call_started(self, transport: asyncio.Transport) -> None:
        self._calls[transport] = self._calls.get(transport, 0) + 1
        idle = self._idle.pop(transport, None)
        if idle is not None:
            idle.cancel()
        self._cap.busy(transport)

    def _call_ended(self, transport: asyncio.Transport) -> None:
        if transport not in self._calls:
            return  # the connection is gone
        self._calls[transport] -= 1
        if not self._calls[transport]:
            self._went_idle(transport)

    def _went_idle(self, transport: asyncio.Transport) -> None:
        """The connection has no call under way: it gives way first at the cap, and goes after IDLE_TIMEOUT."""
        self._calls[transport] = 0
        self._cap.idle(transport)
        self._idle[transport] = asyncio.get_running_loop().call_later(IDLE_TIMEOUT, transport.abort)

    async def serve(self, transport: asyncio.Transport, client: str, early: bytearray) -> None:
        self._transports.add(transport)
        try:
            await self._forward(transport, client, early)
        finally:
            self._cap.release(transport)
            self._transports.discard(transport)
            self._calls.pop(transport, None)
            idle = self._idle.pop(transport, None)
            if idle is not None:
                idle.cancel()
            transport.abort()

    async def _forward(self, transport: asyncio.Transport, client: str, early: bytearray) -> None:
        loop = asyncio.get_running_loop()
        relay = _ClientSide(loop)
        tls: asyncio.Transport | None = None
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                start = asyncio.ensure_future(loop.start_tls(transport, relay, self.context(), server_side=True,
                                                             ssl_shutdown_timeout=CLOSE_TIMEOUT))
                # Once start_tls has run to its first wait, its TLS protocol reads the socket. Bytes read
                # before (uvloop only, see _Accepted) go to that protocol right after its connection_made
                # and the resume_reading that start_tls scheduled, in the same batch of callbacks, so
                # before anything read later.
                try:
                    await asyncio.sleep(0)
                    if early:
                        loop.call_soon(_feed, transport.get_protocol(), bytes(early))
                    tls = await start
                finally:
                    start.cancel()  # only if this ended before it did
                assert tls is not None
                tls.set_write_buffer_limits(high=2 * RELAY_CHUNK)
                relay.secured(tls)
                first = await relay.first
        except (ssl.SSLError, OSError, TimeoutError) as error:
            _refusals.warning(logs.event("secure port: TLS handshake refused", client=client, reason=_reason(error)))
            if tls is not None:
                tls.abort()
            return
        assert tls is not None
        try:
            if first:
                await self._relay(transport, tls, relay)
        finally:
            tls.close()  # flushes what is left to the client, or gives up after CLOSE_TIMEOUT
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await asyncio.shield(relay.lost)

    async def _relay(self, transport: asyncio.Transport, tls: asyncio.Transport, relay: _ClientSide) -> None:
        """The bytes between the client's TLS connection and a new one to the inner server, as they come
        (protocol callbacks, no task per direction); each side's full write buffer pauses the other's reading."""
        der = tls.get_extra_info("ssl_object").getpeercert(binary_form=True)
        cert = x509.load_der_x509_certificate(der) if der else None
        loop = asyncio.get_running_loop()
        try:
            backend, _ = await loop.create_connection(lambda: _InnerSide(relay), "127.0.0.1", self.backend_port)
        except OSError as error:
            log.error("secure port: inner gRPC server unreachable: %s", error)
            return
        peer = f"ipv4:127.0.0.1:{backend.get_extra_info('sockname')[1]}"
        self._peers[peer] = cert  # before a byte is forwarded, so every RPC finds it
        self._fronts[peer] = transport
        self._clients[peer] = _grpc_peer(transport.get_extra_info("peername"))
        try:
            # Either side closing ends both: a client that stopped reading must not keep the connection
            # when the inner server has dropped it (its keepalive failed).
            relay.join(backend)
            await relay.ended
        finally:
            backend.close()
            del self._peers[peer]
            del self._fronts[peer]
            del self._clients[peer]


class _ClientSide(asyncio.Protocol):
    """The client's side of a relayed connection, as the TLS transport's protocol: what the client
    sends goes to the inner server (held until it is connected, reading paused meanwhile)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.first: asyncio.Future[bytes] = loop.create_future()  # the client's first bytes (b"": none came)
        self.ended: asyncio.Future[None] = loop.create_future()  # either side is gone
        self.lost: asyncio.Future[None] = loop.create_future()  # the client's connection is closed
        self.tls: asyncio.Transport | None = None
        self.inner: asyncio.Transport | None = None
        self._held = bytearray()

    def secured(self, tls: asyncio.Transport) -> None:
        """The TLS transport (start_tls does not call connection_made) once the handshake is done."""
        self.tls = tls
        if self._held:
            tls.pause_reading()

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.write(data)
            return
        self._held += data
        if not self.first.done():
            self.first.set_result(bytes(data))
        if self.tls is not None:
            self.tls.pause_reading()  # until the inner server takes it

    def join(self, inner: asyncio.Transport) -> None:
        self.inner = inner
        inner.write(bytes(self._held))
        self._held.clear()
        if self.tls is not None and not self.ended.done():
            self.tls.resume_reading()

    def eof_received(self) -> bool:
        return False  # TLS has no half-close: the connection ends with the client's data

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.first.done():
            self.first.set_result(b"")
        for future in (self.ended, self.lost):
            if not future.done():
                future.set_result(None)

    def pause_writing(self) -> None:  # the client does not keep up: stop reading the inner server
        if self.inner is not None:
            self.inner.pause_reading()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_reading()


class _InnerSide(asyncio.BufferedProtocol):
    """The inner server's side of a relayed connection: what it sends goes to the client over TLS, read
    RELAY_CHUNK at a time. A TLS transport encrypts each write whole into a memory buffer that keeps its
    largest size for the connection's life: the event loop's own reads (256 kB) would leave that much
    behind on every connection."""

    def __init__(self, client: _ClientSide) -> None:
        self.client = client

    def get_buffer(self, sizehint: int) -> memoryview:
        return _RELAY_BUFFER  # copied out before the next read, so every connection of the loop shares it

    def buffer_updated(self, nbytes: int) -> None:
        if self.client.tls is not None:
            self.client.tls.write(bytes(_RELAY_BUFFER[:nbytes]))

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.client.ended.done():
            self.client.ended.set_result(None)

    def pause_writing(self) -> None:  # the inner server does not keep up: stop reading the client
        if self.client.tls is not None:
            self.client.tls.pause_reading()

    def resume_writing(self) -> None:
        if self.client.tls is not None:
            self.client.tls.resume_reading()


class _Accepted(asyncio.Protocol):
    """Holds a new connection still, so the TLS handshake sees its very first byte.

    asyncio reads nothing from a transport paused in connection_made; uvloop starts reading right
    after connection_made whatever it did, so what arrives before start_tls is kept for it here.
    """

    def __init__(self, front: TlsFront) -> None:
        self.front = front
        self.early = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports do not derive from asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.pause_reading()
        self.front.accept(self.transport, self.early)

    def data_received(self, data: bytes) -> None:
        self.early += data
        if self.transport is not None:
            self.transport.pause_reading()


def _feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    """`data` to `protocol` as its transport would hand it over (TLS protocols are buffered ones)."""
    if not hasattr(protocol, "get_buffer"):
        cast(asyncio.Protocol, protocol).data_received(data)
        return
    buffered = cast(asyncio.BufferedProtocol, protocol)
    view = memoryview(data)
    while view:
        buffer = memoryview(buffered.get_buffer(len(view)))
        size = min(len(buffer), len(view))
        buffer[:size] = view[:size]
        buffered.buffer_updated(size)
        view = view[size:]


def _address(peername: object) -> str:
    return join_host_port(peername[0], peername[1]) if isinstance(peername, tuple) else str(peername)


def _grpc_peer(peername: object) -> str:
    """A socket's peer address as gRPC writes one (`ipv4:10.1.2.3:5`, `ipv6:[fd00::1]:5`)."""
    if not isinstance(peername, tuple):
        return str(peername)
    return f"{'ipv6' if ':' in peername[0] else 'ipv4'}:{_address(peername)}"


def _reason(error: BaseException) -> str:
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"client certificate not accepted ({error.verify_message})"
    if isinstance(error, TimeoutError):
        return f"no handshake within {HANDSHAKE_TIMEOUT:g}s"
    return str(error) or type(error).__name__

"""ADS worker processes (`--xds-workers N`): the plaintext xDS port served by N processes at once.

Python serves one core per process, and a push costs a few ms of CPU per connection; so with N > 1
the main process keeps the sources, the store, the debounce (its Pusher), the CA, 15012 and the debug
ports, and N worker processes each bind the xDS port with SO_REUSEPORT, the kernel spreading new
connections among them. The main process does not accept on that port itself.

What reaches a worker: after each push of the main process, the objects that push changed (their
model values as the main process converted them, or their deletion), its version and the mesh config,
pickled over the worker's stdin. The worker keeps those values (not the raw objects, nor the sources'
state) and builds the same snapshot version from the previous one and what changed, then wakes its
connections as a single process would: same versions on every worker, one debounce, and each change
built once per worker (the build is a small part of a push next to generating and sending for every
connection). A worker starts with every object's value. It imports only what serving takes: not the
Kubernetes client (50 MB of RSS), so not istiod.settings either.

A second istiod must still fail on a port in use (grpcio's SO_REUSEPORT is off for the single-process
port): the main process first binds the port without SO_REUSEPORT, which fails if anything holds it,
then holds it with SO_REUSEPORT but without listening (so it takes no connections) until it stops; the
workers join that group. A worker listens once it holds the snapshot of synced sources, so no stream is
refused as "not ready" by one while others could serve it. A worker that ends is started again (its
clients reconnect to the others).

The debug views of connections and the xDS metrics are the main process's: it asks every worker
(a Query over stdin, an Answer over the worker's own pipe) and adds their answers to its own
(istiod/debug/connections.py); a connection's ID names its worker (`<proxy>-w<pid>.<n>`). A worker
that does not answer within ANSWER_TIMEOUT makes the view fail with 503 rather than show part of it.
Counters live in each worker, so a worker that ends takes its counts with it: Prometheus reads the
drop as a counter reset, as after a restart of istiod. (prometheus-client's multiprocess mode would
keep them, but it cannot remove a series, which pilot_xds_*_reject needs.)

The secure port (15012) is served by the workers too, with the main process signing CSRs and
checking tokens for them: see secureworker.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from istiod import autoregistration, logs
from istiod.ca.serving import ServingPem
from istiod.debug import connections
from istiod.connlimit import HANDSHAKE_TIMEOUT, IDLE_TIMEOUT
from istiod.debug.connections import Question, Unanswered
from istiod.eventloop import run_fast
from istiod.memory import settle_heap, trim_when_free
from istiod.model.builder import build_snapshot
from istiod.model.mesh import MeshConfig
from istiod.model.names import join_host_port
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Change, Store, StoredObject
from istiod.keepalive import Keepalive
from istiod.xds import admission
from istiod.xds.connection import tag_connections
from istiod.xds.pusher import PushEvent, Pusher
from istiod.xds.secureworker import Authenticate, Refused, SecureAnswer, SecureServing, SecureStart, Sign
from istiod.xds.server import DiscoveryServer, add_to_server

if TYPE_CHECKING:  # not imported by a worker: istiod.settings brings in the Kubernetes client (50 MB)
    from istiod.ca.serving import ServingCertificate
    from istiod.settings import Settings

log = logging.getLogger(__name__)
_LENGTH = struct.Struct("!I")
# How long a debug view or a scrape waits for a worker busy with a push to answer.
ANSWER_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class Push:
    """One push of the main process: what it changed, as model values (None: deleted)."""

    version: str
    objects: tuple[tuple[ObjectKey, Any], ...]
    full: bool
    mesh: MeshConfig
    reason: dict[str, int]
    configs: tuple[str, ...]
    debounce_seconds: float
    build_seconds: float
    published_at: float  # wall clock: the worker counts the time to reach it into its proxies' convergence
    jwks: tuple[tuple[str, str], ...] = ()  # the keys the main process fetched, by jwksUri


@dataclass(frozen=True, slots=True)
class Start:
    """What a worker is given of istiod's settings."""

    host: str
    port: int
    keepalive: Keepalive
    push_concurrency: int
    send_timeout: float
    max_requests_per_second: float  # the worker's share
    shutdown_duration: float
    max_connections: int  # the worker's, on the shared port
    log_level: str
    log_format: str
    secure: SecureStart | None  # the secure port too, unless istiod serves it in the main process


@dataclass(frozen=True, slots=True)
class Ready:
    ready: bool


@dataclass(frozen=True, slots=True)
class Query:
    number: int
    question: Question


@dataclass(frozen=True, slots=True)
class Reply:
    number: int  # the Ask's
    value: Any


# From a worker to the main process, over its own pipe (stdout is the log's, as stderr).
@dataclass(frozen=True, slots=True)
class Listening:
    """The worker listens on the port."""


@dataclass(frozen=True, slots=True)
class Answer:
    number: int  # the Query's
    value: Any


@dataclass(frozen=True, slots=True)
class Ask:
    """A secure-port call's question for the main process (secureworker.py), or what a connection
    tells its WorkloadEntry controller (autoregistration.py); answered by a Reply."""

    number: int
    question: Sign | Authenticate | autoregistration.Question


def ads_server(ads: DiscoveryServer, health_servicer: health.aio.HealthServicer, keepalive: Keepalive,
               reuse_port: bool, max_connections: int) -> grpc.aio.Server:
    """A gRPC server for the xDS port: ADS and health, core's limits as admission.py explains, and the
    connection rules of istiod's other ports (connlimit.py): at most `max_connections` (core closes
    those past it), the HTTP/2 preface within HANDSHAKE_TIMEOUT, closed after IDLE_TIMEOUT without a call."""
    server = grpc.aio.server(options=[*admission.CORE_OPTIONS, ("grpc.so_reuseport", int(reuse_port)),
                                      *keepalive.server_options(),
                                      ("grpc.max_allowed_incoming_connections", max_connections),
                                      ("grpc.server_handshake_timeout_ms", round(HANDSHAKE_TIMEOUT * 1000)),
                                      ("grpc.max_connection_idle_ms", round(IDLE_TIMEOUT * 1000))])
    add_to_server(ads, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server


def reserve_port(host: str, port: int) -> socket.socket:
    """The port for the workers (a free one for 0): fails with EADDRINUSE if anything holds it, then
    held with SO_REUSEPORT, not listening, so only processes that set it too (the workers) may join."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host or "0.0.0.0", port))
        port = probe.getsockname()[1]
    held = socket.socket(family, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind((host or "0.0.0.0", port))
    return held


class WorkerPool:
    """The main process's side: starts the workers and forwards each push to them."""

    def __init__(self, settings: Settings, store: Store, pusher: Pusher) -> None:
        self.settings = settings
        self.store = store
        self.pusher = pusher
        self._changed: dict[ObjectKey, None] = {}  # since the last push, in order
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._listening: set[int] = set()
        self._numbers = itertools.count(1)
        self._waiting: dict[int, tuple[int, asyncio.Future[Any]]] = {}  # query number -> (worker, its answer)
        self._ready = False
        self._socket: socket.socket | None = None
        self.port = 0
        self._secure_socket: socket.socket | None = None
        self._secure: tuple[SecureAnswer, str | None, ServingCertificate] | None = None
        self._asked: set[asyncio.Task[None]] = set()  # the workers' questions being answered
        self.registrar: autoregistration.Registrar | None = None  # the main process's WorkloadEntry controller
        store.subscribe(self._on_change)
        pusher.subscribe(self._on_push)

    def reserve(self) -> int:
        address = self.settings.grpc_addr
        self._socket = reserve_port(address.bind_host, address.port)
        self.port = self._socket.getsockname()[1]
        return self.port

    def serve_secure(self, answer: SecureAnswer, token_authenticator: str | None, serving: ServingCertificate) -> int:
        """The workers serve the secure port too: reserved here as the xDS port is; `answer` answers
        their questions (secureworker.py), `token_authenticator` names the one the main process has."""
        address = self.settings.secure_grpc_addr
        self._secure_socket = reserve_port(address.bind_host, address.port)
        self._secure = (answer, token_authenticator, serving)
        serving.subscribe(self._send_all)  # each renewed certificate, for the connections to come
        return self._secure_socket.getsockname()[1]

    def _on_change(self, change: Change) -> None:
        self._changed[change.key] = None

    def _on_push(self, event: PushEvent) -> None:
        keys, self._changed = self._changed, {}
        self._send_all(self._push(tuple(keys), event))

    def _push(self, keys: tuple[ObjectKey, ...], event: PushEvent) -> Push:
        objects = tuple((key, stored.value if (stored := self.store.get(key)) is not None else None) for key in keys)
        return Push(event.snapshot.version, objects, event.full, self.pusher.mesh, event.reason, event.configs,
                    event.debounce_seconds, event.build_seconds, time.time(), tuple(self.pusher.jwks.items()))

    def not_ready(self) -> str | None:
        """istiod is not ready before every worker listens (each does once it holds the synced snapshot):
        else the first would take every client."""
        starting = self.settings.xds_workers - len(self._listening)
        return f"{starting} xds workers are not serving yet" if starting else None

    def set_ready(self, ready: bool) -> None:
        self._ready = ready
        self._send_all(Ready(ready))

    def _send_all(self, message: object) -> None:
        data = _frame(message)  # pickled once for every worker
        for writer in self._writers.values():
            writer.write(data)

    async def ask(self, question: Question) -> list[Any]:
        """Every serving worker's answer (a worker that ends meanwhile has no connections left to tell of)."""
        data = {}
        for index in sorted(self._listening):
            number = next(self._numbers)
            self._waiting[number] = (index, asyncio.get_running_loop().create_future())
            self._writers[index].write(_frame(Query(number, question)))
            data[number] = index
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT):
                answers = await asyncio.gather(*(self._waiting[n][1] for n in data), return_exceptions=True)
        except TimeoutError:
            late = sorted(index for number, index in data.items() if not self._waiting[number][1].done())
            raise Unanswered(f"xds worker {late[0]} did not answer within {ANSWER_TIMEOUT:g}s") from None
        finally:
            for number in data:
                self._waiting.pop(number, None)
        return [a for a in answers if not isinstance(a, asyncio.CancelledError)]

    async def run(self, index: int) -> None:
        """One worker, for the supervisor: ends (to be restarted) when the worker does."""
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "from istiod.xds import workers; workers.main()",
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        self._procs[index] = proc
        try:
            every = tuple(o.key for o in self.store.objects())
            proc.stdin.write(_frame(self._start()))
            proc.stdin.write(_frame(self._push(every, PushEvent(self.pusher.snapshot))))
            proc.stdin.write(_frame(Ready(self._ready)))
            self._writers[index] = proc.stdin
            async for message in _messages(proc.stdout):
                if isinstance(message, Answer):
                    _, future = self._waiting.get(message.number, (index, None))
                    if future is not None and not future.done():
                        future.set_result(message.value)
                elif isinstance(message, Ask):
                    task = asyncio.create_task(self._reply(proc.stdin, message, self._answer))
                    self._asked.add(task)
                    task.add_done_callback(self._asked.discard)
                elif isinstance(message, Listening):
                    self._listening.add(index)
                    log.info(logs.event("xds worker started", worker=index, pid=proc.pid, port=self.port))
            code = await proc.wait()
            raise RuntimeError(f"xds worker {index} (pid {proc.pid}) ended with {code}")
        finally:
            self._writers.pop(index, None)
            self._listening.discard(index)
            for asked, future in self._waiting.values():
                if asked == index:
                    future.cancel()
            if proc.returncode is None:
                proc.kill()

    async def _answer(self, question: Sign | Authenticate | autoregistration.Question) -> Any:
        if isinstance(question, (Sign, Authenticate)):
            if self._secure is None:
                return Refused(grpc.StatusCode.UNAVAILABLE.name, "this istiod serves no secure port")
            return await self._secure[0](question)
        if self.registrar is None:
            return None
        return await autoregistration.answer(self.registrar, question)

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, ask: Ask,
                     answer: Callable[[Sign | Authenticate | autoregistration.Question], Awaitable[Any]]) -> None:
        try:
            value = await answer(ask.question)
        except Exception:  # the worker's caller must not wait for an answer that never comes
            log.exception("secure port: a worker's question failed")
            value = Refused(grpc.StatusCode.INTERNAL.name, "istiod failed to answer")
        if not writer.is_closing():
            writer.write(_frame(Reply(ask.number, value)))

    def _start(self) -> Start:
        settings = self.settings
        secure = None
        if self._secure is not None and self._secure_socket is not None:
            _, token_authenticator, serving = self._secure
            assert serving.pem is not None
            secure = SecureStart(settings.secure_grpc_addr.bind_host, self._secure_socket.getsockname()[1],
                                 token_authenticator, serving.pem)
        # The rate of new streams is istiod's: each worker admits its share of it.
        return Start(settings.grpc_addr.bind_host, self.port, settings.keepalive,
                     settings.push_concurrency, settings.xds_send_timeout,
                     settings.max_requests_per_second / settings.xds_workers, settings.shutdown_duration,
                     settings.max_connections, *logs.current(), secure)

    async def stop(self, grace: float) -> None:
        """Each worker drains its streams for `grace` (as the single process's port does), then ends."""
        for writer in self._writers.values():
            writer.close()  # the worker reads the end of its input as the order to stop
        running = [p for p in self._procs.values() if p.returncode is None]
        if running:
            await asyncio.wait([asyncio.create_task(p.wait()) for p in running], timeout=grace + 5)
            for proc in running:
                if proc.returncode is None:
                    proc.kill()
        for task in list(self._asked):
            task.cancel()
        for held in (self._socket, self._secure_socket):
            if held is not None:
                held.close()


def _frame(message: object) -> bytes:
    data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


async def _messages(reader: asyncio.StreamReader) -> Any:
    while True:
        try:
            header = await reader.readexactly(_LENGTH.size)
        except asyncio.IncompleteReadError:
            return  # the main process closed the pipe or ended
        yield pickle.loads(await reader.readexactly(_LENGTH.unpack(header)[0]))


class _Values:
    """A worker's objects: their model values by key, what the snapshot builder reads of a Store."""

    def __init__(self) -> None:
        self._by_kind: dict[str, dict[ObjectKey, StoredObject]] = defaultdict(dict)

    def put(self, key: ObjectKey, value: Any) -> None:
        if value is None:
            self._by_kind[key.kind].pop(key, None)
        else:
            self._by_kind[key.kind][key] = StoredObject(key, {}, value)  # the raw object stays in the main process

    def values(self, kind: str) -> Iterator[Any]:
        return (o.value for o in self._by_kind[kind].values())

    def get(self, key: ObjectKey) -> StoredObject | None:
        return self._by_kind[key.kind].get(key)


class _Worker:
    """A worker process: its own objects and snapshots, fed by the main process's pushes."""

    def __init__(self, start: Start, out: asyncio.StreamWriter) -> None:
        self.start = start
        self.out = out
        tag_connections(f"w{os.getpid()}.")
        self.objects = _Values()
        self.snapshot = build_snapshot(self.objects, "")
        self.ads = DiscoveryServer(lambda: self.snapshot, start.push_concurrency, start.send_timeout,
                                   start.max_requests_per_second)
        self.health = health.aio.HealthServicer()
        self.server = ads_server(self.ads, self.health, start.keepalive, reuse_port=True,
                                 max_connections=start.max_connections)
        self.server.add_insecure_port(join_host_port(start.host, start.port))
        self._numbers = itertools.count(1)
        self._asked: dict[int, asyncio.Future[Any]] = {}  # Ask number -> its Reply's value
        self.ads.registrar = autoregistration.RemoteRegistrar(self.ask)
        self.secure = (SecureServing(start.secure, self.ads, lambda: self.snapshot.mesh, self.ask, start.keepalive,
                                     start.max_connections) if start.secure is not None else None)

    async def ask(self, question: Sign | Authenticate | autoregistration.Question) -> Any:
        """The main process's answer (a secure-port call waits for it as for any peer's)."""
        number = next(self._numbers)
        future = self._asked[number] = asyncio.get_running_loop().create_future()
        try:
            self.out.write(_frame(Ask(number, question)))
            return await future
        finally:
            del self._asked[number]

    def apply(self, push: Push) -> None:
        for key, value in push.objects:
            self.objects.put(key, value)
        keys = None if push.full else [key for key, _ in push.objects]
        self.snapshot = build_snapshot(self.objects, push.version, self.snapshot, keys, push.mesh, dict(push.jwks))
        self.ads.on_push(PushEvent(self.snapshot, push.reason, debounce_seconds=push.debounce_seconds,
                                   build_seconds=push.build_seconds + time.time() - push.published_at,
                                   full=push.full, configs=push.configs))

    async def serve(self, messages: Any) -> None:
        listening = False
        async for message in messages:
            if isinstance(message, Push):
                self.apply(message)
            elif isinstance(message, Query):
                answer = connections.answer(message.question, self.ads.connections, self.ads.monitor.last_push)
                self.out.write(_frame(Answer(message.number, answer)))
            elif isinstance(message, Reply):
                if (future := self._asked.get(message.number)) is not None and not future.done():
                    future.set_result(message.value)
            elif isinstance(message, ServingPem) and self.secure is not None:
                self.secure.install(message)
            elif isinstance(message, Ready):
                self.ads.ready = message.ready
                await self.health.set("", health_pb2.HealthCheckResponse.SERVING if message.ready
                                      else health_pb2.HealthCheckResponse.NOT_SERVING)
                # Only now, with the whole snapshot built: a worker that listened before would refuse
                # its share of the new streams (UNAVAILABLE) while the others could serve them.
                if message.ready and not listening:
                    settle_heap()  # the whole snapshot is built, as the main process's when it turns ready
                    await self.server.start()
                    if self.secure is not None:
                        await self.secure.start()
                    self.out.write(_frame(Listening()))
                    listening = True
        self.ads.ready = False
        if listening:
            grace = self.start.shutdown_duration
            await asyncio.gather(self.server.stop(grace=grace), *([self.secure.stop(grace)] if self.secure else []))


async def _main() -> int:
    # SIGINT and SIGTERM go to the whole group; the main process says when to stop by closing stdin.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 30)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(0, "rb", buffering=0))
    # Frames to the main process on what was stdout; anything printed goes to stderr with the log.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(out_fd, "wb", buffering=0))
    out = asyncio.StreamWriter(transport, protocol, None, loop)
    messages = _messages(reader)
    start = await anext(messages)
    assert isinstance(start, Start)
    logs.setup(start.log_level, start.log_format)
    trimmer = asyncio.create_task(trim_when_free())  # a worker's pushes free memory as the main process's do
    try:
        await _Worker(start, out).serve(messages)
    finally:
        trimmer.cancel()
    return 0


def main() -> None:
    """A worker's entry (not `-m`: its messages must unpickle as this module's classes, not __main__'s)."""
    sys.exit(run_fast(_main()))

"""The ADS server (state of the world and delta): streams, ACK/NACK, nonces, subscriptions and pushes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeAlias

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2, json_format
from google.protobuf.message import DecodeError

from istiod import logs
from istiod.model.proxy import NodeIdError, Proxy, proxy_from_node
from istiod.model.snapshot import Snapshot
from istiod.xds import delta, types
from istiod.xds.admission import RateLimited, RequestLimiter
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.changes import endpoint_changes
from istiod.xds.connection import Closed, Connection, Event, Held, PushScope, Request, StreamClosed, WatchedResource
from istiod.xds.gen import generators_for
from istiod.xds.monitor import AdsMonitor
from istiod.xds.pusher import PushEvent
from istiod.xds.watchers import Watchers

log = logging.getLogger(__name__)
_malformed = logs.Throttled(log)
_refused = logs.Throttled(log)  # a connect storm refuses many streams a second
# A request naming more resources than this is refused: far beyond any mesh's clusters, and a bound on
# what one client can make every later push send.
MAX_RESOURCE_NAMES = 100_000
# Checks the caller may connect as the proxy; aborts the stream if not.
Authorizer = Callable[[Proxy, grpc.aio.ServicerContext], Awaitable[None]]
Response: TypeAlias = discovery_pb2.DiscoveryResponse | discovery_pb2.DeltaDiscoveryResponse


class DiscoveryServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, snapshot: Callable[[], Snapshot], push_concurrency: int = 100, send_timeout: float = 5.0,
                 max_requests_per_second: float = 0.0) -> None:
        self._snapshot = snapshot
        self.cache = ResourceCache()
        self.connections: dict[str, Connection] = {}
        self.watchers = Watchers()
        self._published: Snapshot | None = None  # the snapshot of the last push, to tell what the next changed
        self.ready = False  # set once the sources synced and the first snapshot exists
        self.monitor = AdsMonitor()
        # Throttles building pushes only: a send never holds a slot, so a client that stops reading
        # costs only its own stream.
        self._push_slots = asyncio.Semaphore(push_concurrency)
        self.send_timeout = send_timeout  # 0: none (PILOT_XDS_SEND_TIMEOUT)
        self.admission = RequestLimiter(max_requests_per_second)  # PILOT_MAX_REQUESTS_PER_SECOND

    def on_push(self, event: PushEvent) -> None:
        """Wakes the connections the change concerns: for a change of endpoints and pods only, those
        watching the changed services' clusters (for EDS, or CDS if their identities changed) and
        those of the pods concerned (for everything); for anything else, all of them."""
        previous, self._published = self._published, event.snapshot
        changes = endpoint_changes(previous, event.snapshot)
        woken: dict[Connection, PushScope | None]
        if changes is None:
            # Only a push that regenerates everything tells which cache entries are no longer used.
            self.cache.sweep()
            woken = dict.fromkeys(self.connections.values())
        else:
            woken = self.watchers.woken(changes)
        self.monitor.published(event, [c.id for c in woken], len(self.connections))
        for connection, scope in woken.items():
            connection.request_push(scope)

    def authorized(self, authorize: Authorizer) -> ads_pb2_grpc.AggregatedDiscoveryServiceServicer:
        """This server as seen from a listener whose callers must prove who they are (the TLS port)."""
        return _Authorized(self, authorize)

    async def stream(
        self,
        request_iterator: AsyncIterator[Request],
        context: grpc.aio.ServicerContext,
        authorize: Authorizer | None = None,
        incremental: bool = False,
    ) -> None:
        # A coroutine writing with context.write (not an async generator), so each send has a deadline
        # and the stream can end with a status while a send is still stuck on the client.
        if not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is not ready to serve discovery information")
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            return
        except DecodeError as error:
            _end(context, _malformed_request(context.peer(), error))
            return
        # After the first request (istiod waits before it): a client whose first send is still under
        # way when the stream ends sees that send fail, and grpcio then reports INTERNAL, not our status.
        try:
            await self.admission.wait()
        except RateLimited as refused:
            _refused.warning(logs.event("ads stream refused", peer=context.peer(), reason=str(refused)))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(refused))
        connection = await self._connect(first, context, authorize, incremental)
        self.connections[connection.id] = connection
        self.watchers.add(connection)
        self.monitor.connected(connection)
        log.info(logs.event("ads connected", id=connection.id, peer=connection.peer, delta=incremental))
        await connection.received(first)
        del first  # parsed; the node's metadata need not live as long as the stream
        reader = asyncio.create_task(_read(request_iterator, connection))
        try:
            await self._serve(connection, context)
        except StreamClosed as closed:
            _end(context, closed.closed)
        finally:
            reader.cancel()
            del self.connections[connection.id]
            self.watchers.remove(connection)
            self.monitor.disconnected(connection)
            log.info(logs.event("ads disconnected", id=connection.id))

    async def _serve(self, connection: Connection, context: grpc.aio.ServicerContext) -> None:
        """The connection's task: answers its requests and sends its pushes, one event at a time."""
        while not isinstance(event := await connection.next_event(), Closed):
            await self._handle(connection, context, event)
            # Not held while the next event is awaited, by every idle connection (an Envoy's EDS
            # request names every cluster). The responses went with _handle's frame.
            del event
        if event.code is not grpc.StatusCode.OK:
            raise StreamClosed(event)

    async def _handle(self, connection: Connection, context: grpc.aio.ServicerContext, event: Event) -> None:
        started = time.perf_counter()
        snapshot = self._snapshot()  # one snapshot for everything this event sends
        if event is Connection.PUSH:
            waited, scope = connection.push_started()
            self.monitor.dequeued(waited)
            async with self._push_slots:
                responses = self._push(connection, snapshot, scope)
        elif isinstance(event, discovery_pb2.DeltaDiscoveryRequest):
            responses = self._on_delta_request(connection, event, snapshot)
        else:
            assert isinstance(event, discovery_pb2.DiscoveryRequest)
            responses = self._on_request(connection, event, snapshot)
        for response in responses:
            await self._send(connection, context, response)
            self.monitor.response_sent(response, time.perf_counter() - started)
        if event is Connection.PUSH:
            self.monitor.pushed(connection, snapshot.version, len(responses))

    async def _send(self, connection: Connection, context: grpc.aio.ServicerContext, response: Response) -> None:
        """One response at a time per stream: a client that does not read holds back only its own stream,
        and after the send timeout that stream is closed (istiod's "Timeout writing")."""
        try:
            async with asyncio.timeout(self.send_timeout or None):
                await context.write(response)
        except TimeoutError:
            self.monitor.write_timeout()
            log.warning(logs.event("ads send timeout; closing the stream", id=connection.id,
                                   type=types.short_name(response.type_url), timeout=f"{self.send_timeout:g}s"))
            raise StreamClosed(Closed(grpc.StatusCode.DEADLINE_EXCEEDED, "timeout sending")) from None

    StreamAggregatedResources = stream  # the plaintext port: no caller checks, as in istiod

    async def DeltaAggregatedResources(  # noqa: N802 (gRPC's method name)
        self, request_iterator: AsyncIterator[Request], context: grpc.aio.ServicerContext,
        authorize: Authorizer | None = None,
    ) -> None:
        await self.stream(request_iterator, context, authorize, incremental=True)

    async def _connect(
        self, first: Request, context: grpc.aio.ServicerContext, authorize: Authorizer | None, incremental: bool
    ) -> Connection:
        if not first.node.id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first request must carry node.id")
        try:
            proxy = proxy_from_node(first.node.id, json_format.MessageToDict(first.node.metadata))
        except NodeIdError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if not generators_for(proxy):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{proxy.type} proxies are not served yet")
        if authorize is not None:
            await authorize(proxy, context)
            proxy = dataclasses.replace(proxy, verified=True)
        return Connection(proxy, context.peer(), incremental)

    def _on_request(
        self, connection: Connection, request: discovery_pb2.DiscoveryRequest, snapshot: Snapshot
    ) -> list[discovery_pb2.DiscoveryResponse]:
        type_url = request.type_url
        if type_url not in generators_for(connection.proxy):
            log.warning("ads id=%s asked for unsupported type %s; not answered", connection.id, type_url)
            return []
        watched = connection.watched.get(type_url)
        # A name asked for twice is sent once; interned, so the connections asking for it share one string.
        names = list(dict.fromkeys(map(sys.intern, request.resource_names)))
        if len(names) > MAX_RESOURCE_NAMES:
            raise StreamClosed(Closed(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"{len(names)} resource names in one request; at most {MAX_RESOURCE_NAMES}"))
        if watched is None or not request.response_nonce:
            # A new watch, or a client that reconnected and re-requests: always answer.
            wildcard = not names or "*" in names
            watched = connection.watched[type_url] = WatchedResource(type_url, None if wildcard else names)
            self.watchers.watch(connection, type_url, watched.names)
            return [self._respond(watched, snapshot, self._generate(connection, watched, snapshot))]
        if request.response_nonce != watched.nonce_sent:
            return []  # stale: a reply to a response the client has since been sent a newer one of
        if request.HasField("error_detail"):
            self._nack(connection, watched, request)
            return []
        # The strings already held, not the request's copies of them.
        watched.nonce_acked = watched.nonce_sent
        watched.version_acked = watched.version_sent if request.version_info == watched.version_sent else request.version_info
        watched.acked = watched.sent
        watched.last_error = ""
        if watched.names is not None and names != watched.names:
            watched.names = names
            self.watchers.watch(connection, type_url, names)
            return [self._respond(watched, snapshot, self._generate(connection, watched, snapshot))]
        return []

    def _on_delta_request(
        self, connection: Connection, request: discovery_pb2.DeltaDiscoveryRequest, snapshot: Snapshot
    ) -> list[Response]:
        type_url = request.type_url
        if type_url not in generators_for(connection.proxy):
            log.warning("ads id=%s asked for unsupported type %s; not answered", connection.id, type_url)
            return []
        previous = connection.watched.get(type_url)
        # Unlike state of the world, a delta request may both answer a response and change the
        # subscription, and the change counts even when the nonce is stale.
        if previous is not None and request.response_nonce and request.response_nonce == previous.nonce_sent:
            if request.HasField("error_detail"):
                self._nack(connection, previous, request)
            else:
                delta.acked(previous, request)
        watched, changed = delta.subscribe(previous, request, MAX_RESOURCE_NAMES)
        connection.watched[type_url] = watched
        if not changed:
            return []
        self.watchers.watch(connection, type_url, watched.names)
        resources = self._generate(connection, watched, snapshot)
        if previous is None:
            delta.held(watched, resources, dict(request.initial_resource_versions))
        responses = self._delta_respond(connection, watched, snapshot, resources, always=previous is None)
        endpoints = connection.watched.get(types.ENDPOINT)
        if connection.endpoints_due and endpoints is not None:
            responses += self._delta_respond(connection, endpoints, snapshot,
                                             self._generate(connection, endpoints, snapshot))
        return responses

    def _delta_respond(self, connection: Connection, watched: WatchedResource, snapshot: Snapshot,
                       resources: list[Resource], always: bool = False) -> list[Response]:
        """Only what changed, and after clusters their endpoints again (see Connection.endpoints_due)."""
        resend: frozenset[str] = frozenset()
        if watched.type_url == types.ENDPOINT:
            resend, connection.endpoints_due = frozenset(connection.endpoints_due), set()
        response = delta.respond(watched, snapshot, resources, always, resend)
        if response is None:
            return []
        if watched.type_url == types.CLUSTER:
            connection.endpoints_due.update(r.name for r in response.resources)
        return [response]

    def _nack(self, connection: Connection, watched: WatchedResource, request: Request) -> None:
        """Keep the last good config on this connection; log each rejected nonce once."""
        watched.nacked_nonce = request.response_nonce
        watched.last_error = request.error_detail.message
        self.monitor.nacked(connection, watched, request)
        log.warning(logs.event("ads NACK", id=connection.id, type=types.short_name(watched.type_url),
                               version=watched.version_sent, error=request.error_detail.message))

    def _push(self, connection: Connection, snapshot: Snapshot, scope: PushScope | None = None) -> list[Response]:
        """Regenerates what `scope` says may have changed (everything if None) and sends what did."""
        responses: list[Response] = []
        changed_clusters: set[str] = set()
        for type_url in types.PUSH_ORDER:
            watched = connection.watched.get(type_url)
            if watched is None:
                continue
            names: set[str] | None = None
            if scope is not None and type_url in scope:
                names = scope[type_url]
            elif scope is not None:
                if type_url != types.ENDPOINT or not (changed_clusters or connection.endpoints_due):
                    continue
                names = set()  # only the endpoints of clusters this push changed
            if names is not None and type_url == types.ENDPOINT:
                # Some assignments only, and those whose clusters were just sent (see below and
                # Connection.endpoints_due): the client keeps the others it holds, in SotW too.
                names = names | changed_clusters | connection.endpoints_due
                wanted = sorted(names if watched.names is None else names.intersection(watched.names))
                fresh = {r.name: r for r in self._generate(connection, watched, snapshot, wanted)}
                resources = list({**watched.sent, **fresh}.values())
            else:
                resources = self._generate(connection, watched, snapshot)
            if connection.delta:
                responses += self._delta_respond(connection, watched, snapshot, resources)
            elif type_url == types.ENDPOINT:
                # EDS need not be the state of the world: only the assignments that differ from what
                # the client holds go, and (Envoy warms a changed cluster until it gets its endpoints
                # again, and asks with a request that looks like an ACK) those of changed clusters.
                # What it holds is what it was sent, unless it NACKed that: under churn a push often
                # overtakes the ACK of the previous one, so the ACKed state would lag ever further
                # and each response carry everything changed since.
                held = watched.acked if watched.rejection else watched.sent
                carried = [r for r in resources if r.name in changed_clusters or not r.same_as(held.get(r.name))]
                if carried:
                    responses.append(self._respond(watched, snapshot, resources, carried))
            elif watched.differs_from(resources):
                if type_url == types.CLUSTER:
                    changed_clusters = {r.name for r in resources if not r.same_as(watched.sent.get(r.name))}
                responses.append(self._respond(watched, snapshot, resources))
        return responses

    def _generate(self, connection: Connection, watched: WatchedResource, snapshot: Snapshot,
                  names: list[str] | None = None) -> list[Resource]:
        """What the connection watches of the type, or of it only `names`."""
        generator = generators_for(connection.proxy)[watched.type_url]
        return generator(snapshot, connection.proxy, watched.names if names is None else names, self.cache)

    def _respond(
        self, watched: WatchedResource, snapshot: Snapshot, resources: list[Resource],
        carried: list[Resource] | None = None,
    ) -> discovery_pb2.DiscoveryResponse:
        """`resources` is what the client holds after this response; `carried`, when only part of
        it goes (EDS), what the response holds."""
        version = snapshot.version
        watched.nonce_sent = uuid.uuid4().hex
        watched.version_sent = version
        watched.sent = Held.of(resources)
        watched.sent_at = time.time()
        return discovery_pb2.DiscoveryResponse(
            version_info=version,
            type_url=watched.type_url,
            nonce=watched.nonce_sent,
            resources=[any_pb2.Any(type_url=r.type_url, value=r.value) for r in (resources if carried is None else carried)],
        )


class _Authorized(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, server: DiscoveryServer, authorize: Authorizer) -> None:
        self.server = server
        self.authorize = authorize

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[Request], context: grpc.aio.ServicerContext
    ) -> None:
        await self.server.stream(request_iterator, context, self.authorize)

    async def DeltaAggregatedResources(  # noqa: N802 (gRPC's method name)
        self, request_iterator: AsyncIterator[Request], context: grpc.aio.ServicerContext
    ) -> None:
        await self.server.stream(request_iterator, context, self.authorize, incremental=True)


async def _read(requests: AsyncIterator[Request], connection: Connection) -> None:
    closed = Closed()
    try:
        async for request in requests:
            await connection.received(request)
            del request  # handled by the connection's task: not held while the next is read
    except grpc.aio.AioRpcError:
        pass
    except DecodeError as error:
        closed = _malformed_request(connection.id, error)
    await connection.received(closed)


def _malformed_request(who: str, error: DecodeError) -> Closed:
    """A request that is not a DiscoveryRequest ends its stream; logged without a traceback, and throttled,
    since a client can send them as fast as it likes."""
    _malformed.warning(logs.event("ads malformed request; closing the stream", id=who, error=str(error)))
    return Closed(grpc.StatusCode.INVALID_ARGUMENT, f"malformed DiscoveryRequest: {error}")


def _end(context: grpc.aio.ServicerContext, closed: Closed) -> None:
    # Not context.abort(): it waits until the status is sent, which is never for a client that stopped reading.
    context.set_code(closed.code)
    context.set_details(closed.details)

"""The ADS server (state of the world and delta): streams, ACK/NACK, nonces, subscriptions and pushes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from datetime import datetime, timezone
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeAlias

import grpc
from envoy.service.discovery.v3 import ads_pb2, ads_pb2_grpc, discovery_pb2
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from istiod import logs
from istiod.autoregistration import RegistrationError, Registrar
from istiod.model.proxy import NodeIdError, Proxy, proxy_from_node
from istiod.model.service import Locality
from istiod.model.snapshot import Snapshot
from istiod.xds import debugtypes, delta, types, wire
from istiod.xds.admission import RateLimited, RequestLimiter
from istiod.xds.budget import ByteBudget
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.changes import changes
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
# Bytes of the resource names one stream watches, all types together; a connection's streams together
# may watch twice that. Past either the stream is closed (RESOURCE_EXHAUSTED): names a client makes up
# cost what they weigh, and no client can make this server hold more of them (an Envoy of 100k
# clusters names ~7 MB in its EDS requests).
MAX_NAME_BYTES = 16 << 20
# Checks the caller may connect as the proxy; aborts the stream if not.
# (the proxy it claims to be, the call, the caller's address) -> the service account it proved
Authorizer = Callable[[Proxy, grpc.aio.ServicerContext, str], Awaitable[str]]
Response: TypeAlias = wire.Outgoing
SERVICE = ads_pb2.DESCRIPTOR.services_by_name["AggregatedDiscoveryService"].full_name
# Bytes of responses being written at once, all streams together (see istiod/xds/budget.py).
SEND_BUDGET = 32 << 20


class DiscoveryServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, snapshot: Callable[[], Snapshot], push_concurrency: int = 100, send_timeout: float = 5.0,
                 max_requests_per_second: float = 0.0, send_budget: int = SEND_BUDGET,
                 max_name_bytes: int = MAX_NAME_BYTES) -> None:
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
        self._send_budget = ByteBudget(send_budget)
        self.max_name_bytes = max_name_bytes
        self.name_bytes: dict[str, int] = {}  # per connection (peer address): bytes of the names its streams watch
        self.debug_types: debugtypes.DebugTypes | None = None  # istioctl's queries; None: refused
        # WorkloadEntry auto-registration and health (istiod/autoregistration.py); None: neither.
        self.registrar: Registrar | None = None

    def on_push(self, event: PushEvent) -> None:
        """Wakes the connections the change concerns: for a change of endpoints and pods, those
        watching the changed services' clusters (for EDS, or CDS if their identities changed) and
        those of the pods concerned (for everything); for Istio config, the types that read its
        kinds; for Services, what names them (see Watchers.woken); for anything else, all of them."""
        previous, self._published = self._published, event.snapshot
        changed = changes(previous, event.snapshot)
        if changed is None or changed.hosts - event.snapshot.services.keys():
            # Entries unused since the previous sweep go: a Service gone leaves some unused for good.
            self.cache.sweep()
        woken: dict[Connection, PushScope | None]
        if changed is None:
            woken = dict.fromkeys(self.connections.values())
        else:
            woken = self.watchers.woken(changed)
        self.monitor.published(event, [c.id for c in woken], len(self.connections))
        for connection, scope in woken.items():
            connection.request_push(scope)

    def authorized(self, authorize: Authorizer, peer_of: Callable[[grpc.aio.ServicerContext], str] | None = None,
                   ) -> ads_pb2_grpc.AggregatedDiscoveryServiceServicer:
        """This server as seen from a listener whose callers must prove who they are (the TLS port);
        `peer_of`: a caller's address where gRPC sees another (behind the TLS front)."""
        return _Authorized(self, authorize, peer_of or _peer)

    async def stream(
        self,
        request_iterator: AsyncIterator[Incoming],
        context: grpc.aio.ServicerContext,
        authorize: Authorizer | None = None,
        incremental: bool = False,
        peer: str | None = None,
    ) -> None:
        """`peer`: the caller's address, if not gRPC's (context.peer())."""
        # A coroutine writing with context.write (not an async generator), so each send has a deadline
        # and the stream can end with a status while a send is still stuck on the client.
        if not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is not ready to serve discovery information")
        peer = peer or _peer(context)
        try:
            first = _taken(await anext(request_iterator))
        except StopAsyncIteration:
            return
        except DecodeError as error:
            _end(context, _malformed_request(peer, error))
            return
        # After the first request (istiod waits before it): a client whose first send is still under
        # way when the stream ends sees that send fail, and grpcio then reports INTERNAL, not our status.
        try:
            await self.admission.wait()
        except RateLimited as refused:
            _refused.warning(logs.event("ads stream refused", peer=peer, reason=str(refused)))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(refused))
        connection = await self._connect(first, context, authorize, incremental, peer)
        connected_at = datetime.fromtimestamp(connection.connected_at, timezone.utc)
        if self.registrar is not None:
            try:
                connection.registered = await self.registrar.connected(connection.proxy, connection.id, connected_at)
            except RegistrationError as refused:
                log.warning(logs.event("ads stream refused", id=connection.id, reason=str(refused)))
                await context.abort(refused.code, str(refused))
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
            if connection.registered is not None and self.registrar is not None:
                self.registrar.disconnected(connection.registered, connection.id, connected_at)
            del self.connections[connection.id]
            self._hold_names(connection, 0)
            self.watchers.remove(connection)
            self.monitor.disconnected(connection)
            log.info(logs.event("ads disconnected", id=connection.id))

    async def _serve(self, connection: Connection, context: grpc.aio.ServicerContext) -> None:
        """The connection's task: answers its requests and sends its pushes, one event at a time."""
        # Headers first, on their own: grpcio sends them with the first message otherwise, and when the
        # send deadline interrupts that write it still counts them unsent, so ending the stream fails
        # (TOO_MANY_OPERATIONS) and the client never gets a status: it waits on a dead stream for good.
        await context.send_initial_metadata(())
        deadline = _SendDeadline(self.send_timeout) if self.send_timeout else None
        try:
            await self._events(connection, context, deadline)
        finally:
            if deadline is not None:
                deadline.close()

    async def _events(self, connection: Connection, context: grpc.aio.ServicerContext,
                      deadline: _SendDeadline | None) -> None:
        while not isinstance(event := await connection.next_event(), Closed):
            await self._handle(connection, context, deadline, event)
            # Not held while the next event is awaited, by every idle connection (an Envoy's EDS
            # request names every cluster). The responses went with _handle's frame.
            del event
        if event.code is not grpc.StatusCode.OK:
            raise StreamClosed(event)

    async def _handle(self, connection: Connection, context: grpc.aio.ServicerContext,
                      deadline: _SendDeadline | None, event: Event) -> None:
        started = time.perf_counter()
        snapshot = self._snapshot()  # one snapshot for everything this event sends
        connection.relabel(snapshot.workloads.get((connection.node.namespace, connection.node.pod_name)))
        if event is Connection.PUSH:
            waited, scope = connection.push_started()
            self.monitor.dequeued(waited)
            async with self._push_slots:
                responses = self._push(connection, snapshot, scope)
        elif isinstance(event, Request) and event.type_url == types.HEALTH_INFO:
            self._health(connection, event)
            responses = []
        elif isinstance(event, Request) and debugtypes.is_debug(event.type_url):
            responses = await self._debug(connection, event, snapshot)
        elif isinstance(event, discovery_pb2.DeltaDiscoveryRequest):
            responses = self._on_delta_request(connection, event, snapshot)
        else:
            assert isinstance(event, discovery_pb2.DiscoveryRequest)
            responses = self._on_request(connection, event, snapshot)
        for response in responses:
            await self._send(connection, context, deadline, response)
            self.monitor.response_sent(response, time.perf_counter() - started)
        if event is Connection.PUSH:
            self.monitor.pushed(connection, snapshot.version, len(responses))

    async def _send(self, connection: Connection, context: grpc.aio.ServicerContext,
                    deadline: _SendDeadline | None, response: Response) -> None:
        """One response at a time per stream: a client that does not read holds back only its own stream,
        and after the send timeout that stream is closed (istiod's "Timeout writing")."""
        # The budget's share is per HTTP/2 connection: its streams have one peer address.
        held = await self._send_budget.acquire(response.size, connection.peer)
        try:
            if deadline is None:
                await context.write(bytes(response))
            else:
                await deadline.write(context, bytes(response))
        except TimeoutError:
            self.monitor.write_timeout()
            log.warning(logs.event("ads send timeout; closing the stream", id=connection.id,
                                   type=types.short_name(response.type_url), timeout=f"{self.send_timeout:g}s"))
            raise StreamClosed(Closed(grpc.StatusCode.DEADLINE_EXCEEDED, "timeout sending")) from None
        finally:
            self._send_budget.release(held)

    StreamAggregatedResources = stream  # the plaintext port: no caller checks, as in istiod

    async def DeltaAggregatedResources(  # noqa: N802 (gRPC's method name)
        self, request_iterator: AsyncIterator[Incoming], context: grpc.aio.ServicerContext,
        authorize: Authorizer | None = None,
    ) -> None:
        await self.stream(request_iterator, context, authorize, incremental=True)

    async def _connect(
        self, first: Request, context: grpc.aio.ServicerContext, authorize: Authorizer | None, incremental: bool,
        peer: str,
    ) -> Connection:
        if not first.node.id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first request must carry node.id")
        try:
            where = first.node.locality
            proxy = proxy_from_node(first.node.id, json_format.MessageToDict(first.node.metadata),
                                    Locality(where.region, where.zone, where.sub_zone))
        except NodeIdError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if authorize is not None:
            service_account = await authorize(proxy, context, peer)
            proxy = dataclasses.replace(proxy, verified=True, verified_service_account=service_account)
        return Connection(proxy, peer, incremental)

    def _on_request(
        self, connection: Connection, request: discovery_pb2.DiscoveryRequest, snapshot: Snapshot
    ) -> list[Response]:
        type_url = request.type_url
        if type_url not in generators_for(connection.proxy):
            log.warning("ads id=%s asked for unsupported type %s; not answered", connection.id, type_url)
            return []
        watched = connection.watched.get(type_url)
        if watched is not None and request.response_nonce and request.response_nonce != watched.nonce_sent:
            # Stale, names and all: a reply to a response the client has since been sent a newer one of
            # (under churn many are: pushes overtake the replies to earlier ones).
            return []
        requested, key = request.resource_names, connection.names_key
        if watched is not None and watched.names is not None and key is not None and key == watched.names_key:
            # An ACK naming what is watched (an Envoy's EDS ACK names every cluster, once per response),
            # told by the fingerprint of its bytes.
            names = watched.names
        elif (watched is not None and watched.names is not None and request.response_nonce
                and len(requested) == len(watched.names) and requested == watched.names):
            # The same, from a client that lays its requests out otherwise: compared as it is, not made a
            # list of interned names again (three times the cost).
            names = watched.names
        else:
            # A name asked for twice is sent once; interned, so the connections asking for it share one string.
            names = list(dict.fromkeys(map(sys.intern, requested)))
        if len(names) > MAX_RESOURCE_NAMES:
            raise StreamClosed(Closed(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"{len(names)} resource names in one request; at most {MAX_RESOURCE_NAMES}"))
        if watched is None or names is not watched.names:
            self._bound_names(connection, type_url, names)
        if watched is None or not request.response_nonce:
            # A new watch, or a client that reconnected and re-requests: always answer.
            wildcard = not names or "*" in names
            watched = connection.watched[type_url] = WatchedResource(type_url, None if wildcard else names)
            self.watchers.watch(connection, type_url, watched.names)
            return [self._respond(watched, snapshot, self._generate(connection, watched, snapshot))]
        if request.HasField("error_detail"):
            self._nack(connection, watched, request)
            return []
        # The strings already held, not the request's copies of them.
        watched.nonce_acked = watched.nonce_sent
        watched.version_acked = watched.version_sent if request.version_info == watched.version_sent else request.version_info
        watched.acked = watched.sent
        watched.last_error = ""
        watched.names_key = key
        if watched.names is not None and names is not watched.names and names != watched.names:
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
        named_before = set(previous.names or ()) if previous is not None else set()
        watched, changed = delta.subscribe(previous, request, MAX_RESOURCE_NAMES)
        connection.watched[type_url] = watched
        if not changed:
            return []
        self._bound_names(connection, type_url, watched.names)
        self.watchers.watch(connection, type_url, watched.names)
        resources = self._generate(connection, watched, snapshot)
        if previous is None:
            delta.held(watched, resources, dict(request.initial_resource_versions))
        # A name just subscribed that names nothing is answered as removed, as Istio does: an
        # on-demand ztunnel waits for an answer to each name it asks for. (An Address name may be
        # an IP that finds resources of other names: only one that finds none is unknown.)
        sent = {r.name for r in resources}
        unknown = tuple(n for n in watched.names or () if n not in named_before and n not in sent
                        and not self._generate(connection, watched, snapshot, [n]))
        responses = self._delta_respond(connection, watched, snapshot, resources, always=previous is None,
                                        unknown=unknown)
        endpoints = connection.watched.get(types.ENDPOINT)
        if connection.endpoints_due and endpoints is not None:
            responses += self._delta_respond(connection, endpoints, snapshot,
                                             self._generate(connection, endpoints, snapshot))
        return responses

    def _health(self, connection: Connection, request: Request) -> None:
        """What the proxy's agent probed (no error detail: healthy), for the entry it controls."""
        if connection.registered is None or self.registrar is None:
            log.debug("ads id=%s: health reported for no WorkloadEntry; ignored", connection.id)
            return
        healthy = not request.HasField("error_detail")
        self.registrar.health(connection.registered, healthy, "" if healthy else request.error_detail.message)

    async def _debug(self, connection: Connection, request: Request, snapshot: Snapshot) -> list[Response]:
        """istioctl's queries (istiod's debug types): each request answered once, never pushed."""
        if self.debug_types is None:
            raise StreamClosed(Closed(grpc.StatusCode.UNIMPLEMENTED,
                                      f"{request.type_url} is not served by xDS worker processes; ask the secure port"))
        watched = connection.watched.get(request.type_url)
        if watched is not None and request.response_nonce:  # an ACK, or a reply to an older response
            return []
        incremental = isinstance(request, discovery_pb2.DeltaDiscoveryRequest)
        names = list(request.resource_names_subscribe if incremental else request.resource_names)
        resources = await self.debug_types.generate(connection.proxy, request.type_url, names)
        watched = connection.watched[request.type_url] = WatchedResource(request.type_url, names or None)
        watched.nonce_sent, watched.version_sent, watched.sent_at = wire.nonce(), snapshot.version, time.time()
        if incremental:
            return [wire.delta(snapshot.version, request.type_url, watched.nonce_sent, resources, [])]
        control_plane = self.debug_types.control_plane if request.type_url == debugtypes.SYNCZ else ""
        return [wire.sotw(snapshot.version, request.type_url, watched.nonce_sent, resources, control_plane)]

    def _bound_names(self, connection: Connection, type_url: str, names: list[str] | None) -> None:
        """Counts the bytes of the names the stream watches once it watches `names` of the type; closes
        it past the bound of a stream or of its connection's streams together."""
        held = sum(map(len, names or ())) + sum(len(name) for other, watched in connection.watched.items()
                                                if other != type_url for name in watched.names or ())
        bound = self.max_name_bytes
        if held > bound:
            raise StreamClosed(Closed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"the resource names this stream subscribed to take {held} bytes; "
                                      f"at most {bound} a stream"))
        total = self.name_bytes.get(connection.peer, 0) - connection.name_bytes + held
        if total > 2 * bound:
            raise StreamClosed(Closed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"the resource names this connection's streams subscribed to take {total} "
                                      f"bytes; at most {2 * bound} a connection"))
        self._hold_names(connection, held)

    def _hold_names(self, connection: Connection, held: int) -> None:
        total = self.name_bytes.get(connection.peer, 0) - connection.name_bytes + held
        connection.name_bytes = held
        if total:
            self.name_bytes[connection.peer] = total
        else:
            self.name_bytes.pop(connection.peer, None)

    def _delta_respond(self, connection: Connection, watched: WatchedResource, snapshot: Snapshot,
                       resources: list[Resource], always: bool = False, held: Held | None = None,
                       unknown: tuple[str, ...] = ()) -> list[Response]:
        """Only what changed, and after clusters their endpoints again (see Connection.endpoints_due);
        `held`, `unknown`: see delta.respond."""
        resend: frozenset[str] = frozenset()
        if watched.type_url == types.ENDPOINT:
            resend, connection.endpoints_due = frozenset(connection.endpoints_due), set()
        response = delta.respond(watched, snapshot, resources, always, resend, held, unknown)
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
                wanted = sorted(names if watched.names is None else self.watchers.watching(connection, type_url, names))
                fresh = self._generate(connection, watched, snapshot, wanted)
                sent = watched.sent if isinstance(watched.sent, Held) else Held.of(list(watched.sent.values()))
                held_after = sent.updated(fresh)
                if connection.delta:  # only `fresh` can differ from what the client holds
                    responses += self._delta_respond(connection, watched, snapshot, fresh, held=held_after)
                    continue
                if not changed_clusters and not watched.rejection:
                    # Only `fresh` can differ from what the client holds: the rest is what it was sent.
                    carried = [r for r in fresh if not r.same_as(watched.sent.get(r.name))]
                    if carried:
                        responses.append(self._respond(watched, snapshot, held_after, carried))
                    continue
                resources = list(held_after.values())
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
        self, watched: WatchedResource, snapshot: Snapshot, resources: list[Resource] | Held,
        carried: list[Resource] | None = None,
    ) -> Response:
        """`resources` is what the client holds after this response (a Held when already made);
        `carried`, when only part of it goes (EDS), what the response holds."""
        watched.nonce_sent = wire.nonce()
        watched.version_sent = snapshot.version
        held = watched.sent = resources if isinstance(resources, Held) else Held.of(resources)
        watched.sent_at = time.time()
        return wire.sotw(snapshot.version, watched.type_url, watched.nonce_sent,
                         list(held.values()) if carried is None else carried)


class _SendDeadline:
    """The send timeout of one stream, with one timer per stream (a timer per write cost about as much as
    the write itself), armed for the write under way and re-armed only when it fires.

    It measures the client, not this server: a write that finished while the event loop was busy (a
    connect storm) is seen only once the loop gets to it, and the timer can run first. So the deadline
    ends a write only when a look some time after it finds the write still under way, and that look ran
    on time; a look that ran late (the loop busy) is followed by another.
    """

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._recheck = timeout / 10
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._writes = 0  # writes started on the stream
        self._writing = 0  # the number of the write under way; 0: none
        self._started = 0.0  # when it started
        self._looked = False  # the write under way is past its deadline, and was looked at once since
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    async def write(self, context: grpc.aio.ServicerContext, message: bytes) -> None:
        """Raises TimeoutError when the write is not done within the timeout."""
        self._writes += 1
        self._writing, self._started, self._looked = self._writes, self._loop.time(), False
        if self._timer is None:
            self._arm(self._started + self._timeout)
        try:
            await context.write(message)
        except asyncio.CancelledError:
            if self._expired and self._task.uncancel() == 0:
                raise TimeoutError from None
            raise
        finally:
            self._writing = 0

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _arm(self, when: float) -> None:
        self._timer = self._loop.call_at(when, self._fired, self._writing, when)

    def _fired(self, armed_for: int, due: float) -> None:
        self._timer = None
        if self._writing != armed_for:
            if self._writing:
                self._arm(self._started + self._timeout)  # a later write is under way: its own deadline
            return
        now = self._loop.time()
        if self._looked and now - due <= self._recheck / 2:
            self._expired = True
            self._task.cancel()
            return
        self._looked = True
        self._arm(now + self._recheck)


class _Envelope:
    """A request as grpcio hands it to the stream. grpcio's request iterator keeps the last message it
    yielded while it waits for the next; an idle Envoy's last one is its EDS ACK, naming every cluster
    (some 100 kB of protobuf per connection, for as long as it stays idle). The stream takes the message
    out, so grpcio keeps only the empty envelope."""

    __slots__ = ("message", "names_key")

    def __init__(self, message: Request | None, names_key: int | None = None) -> None:
        self.message = message
        self.names_key = names_key  # wire.names_key of a SotW request


Incoming: TypeAlias = "Request | _Envelope"  # what a stream reads: enveloped from grpcio, bare from others


def _sotw_request(data: bytes) -> _Envelope:
    request = discovery_pb2.DiscoveryRequest.FromString(data)
    return _Envelope(request, wire.names_key(data, request))


def _delta_request(data: bytes) -> _Envelope:
    return _Envelope(discovery_pb2.DeltaDiscoveryRequest.FromString(data))


def _taken(item: _Envelope | Request) -> Request:
    """The request, out of its envelope (callers other than grpcio pass requests as they are)."""
    if not isinstance(item, _Envelope):
        return item
    message, item.message = item.message, None
    assert message is not None, "an envelope is opened once"
    return message


def add_to_server(servicer: ads_pb2_grpc.AggregatedDiscoveryServiceServicer, server: grpc.aio.Server) -> None:
    """Registers the ADS methods as the generated add_AggregatedDiscoveryServiceServicer_to_server does,
    but sending responses as the bytes the servicer wrote (see wire.py), and requests in envelopes."""
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.StreamAggregatedResources, request_deserializer=_sotw_request),
        "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.DeltaAggregatedResources, request_deserializer=_delta_request),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class _Authorized(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, server: DiscoveryServer, authorize: Authorizer,
                 peer_of: Callable[[grpc.aio.ServicerContext], str]) -> None:
        self.server = server
        self.authorize = authorize
        self.peer_of = peer_of

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[Incoming], context: grpc.aio.ServicerContext
    ) -> None:
        await self.server.stream(request_iterator, context, self.authorize, peer=self.peer_of(context))

    async def DeltaAggregatedResources(  # noqa: N802 (gRPC's method name)
        self, request_iterator: AsyncIterator[Incoming], context: grpc.aio.ServicerContext
    ) -> None:
        await self.server.stream(request_iterator, context, self.authorize, incremental=True,
                                 peer=self.peer_of(context))


def _peer(context: grpc.aio.ServicerContext) -> str:
    return context.peer() or ""


async def _read(requests: AsyncIterator[Incoming], connection: Connection) -> None:
    closed = Closed()
    try:
        async for item in requests:
            await connection.received(_taken(item), item.names_key if isinstance(item, _Envelope) else None)
            del item  # handled by the connection's task: not held while the next is read
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

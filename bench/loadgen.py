"""The load generator's worker: one process, many simulated xDS clients, each its own gRPC connection.

Proxyless clients subscribe as gRPC does (LDS for named listeners -> RDS -> CDS -> EDS, ACKing each
response with the names it holds); Envoy-like clients as Envoy does: all clusters and listeners
(wildcard), then EDS for every EDS cluster and RDS for every route configuration the listeners name,
over SotW or delta. Each client records when it was first fully configured (an Envoy-like one: its
assignments and route configurations too) and when it first held each marked address (an endpoint
change): an Envoy-like client, once a route it holds also names the cluster, as traffic needs.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2

from istiod.gen.istio.workload import workload_pb2

LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
ADDRESS = "type.googleapis.com/istio.workload.Address"  # ztunnel's
AUTHORIZATION = "type.googleapis.com/istio.security.Authorization"
MESSAGES: dict[str, Any] = {LDS: listener_pb2.Listener, RDS: route_pb2.RouteConfiguration,
                            CDS: cluster_pb2.Cluster}
# One HTTP/2 connection per client, as separate proxies have: grpc shares subchannels between
# channels of one process unless told not to.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]
TICKS = 10  # traffic is counted per tenth of a second
SETTLE_SECONDS = 30  # at the end, how long clients still catching up are waited for


def mark_address(change: int) -> str:
    """The address the benchmark writes for change `change`, found again in what clients hold."""
    return f"100.{64 + (change >> 16)}.{(change >> 8) & 255}.{change & 255}"


def mark_of(address: str) -> int:
    _, a, b, c = address.split(".")
    return ((int(a) - 64) << 16) | (int(b) << 8) | int(c)


FOLLOWS = {LDS: RDS, RDS: CDS, CDS: EDS}  # Envoy-like clients ask CDS for all (wildcard), not by route
# A SocketAddress's address (field 2, a string) holding a marked address, in the serialized bytes:
# finding marks without parsing every ClusterLoadAssignment keeps the generator off the critical path.
MARKED = re.compile(rb"\x12([\x0a-\x0f])(100\.[0-9.]{5,11})")


def leading_name(value: bytes) -> str:
    """Field 1 of a serialized resource: the name of a Listener, RouteConfiguration, Cluster and
    ClusterLoadAssignment alike (protobuf writes fields in number order)."""
    assert value[:1] == b"\x0a", "a resource without its name first"
    length, shift, pos = 0, 0, 1
    while True:
        byte = value[pos]
        length |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value[pos:pos + length].decode()


def derive(type_url: str, value: bytes) -> set[Any]:
    """What follows from one resource: route names, cluster names, EDS names, or marks held."""
    if type_url == EDS:
        return {mark_of(m[2].decode()) for m in MARKED.finditer(value) if len(m[2]) == m[1][0]}
    if type_url == ADDRESS:  # a workload's marked addresses (4 bytes each)
        return {mark_of(".".join(map(str, ip))) for ip in workload_pb2.Address.FromString(value).workload.addresses
                if len(ip) == 4 and ip[0] == 100}
    if type_url == AUTHORIZATION:
        return set()
    message = MESSAGES[type_url]()
    message.ParseFromString(value)
    if type_url == LDS:
        return route_names(message)
    if type_url == RDS:
        return route_clusters(message)
    return {name} if (name := eds_name(message)) else set()


def hold(client: "Client", type_url: str, name: str, value: bytes, previous: tuple[bytes, set[Any]] | None,
         now: float) -> tuple[bytes, set[Any]]:
    """A resource the client now holds, derived once per content; marks held are recorded (Client.held_marks)."""
    if previous is not None and previous[0] == value:
        return previous
    derived = derive(type_url, value)
    if type_url in (EDS, ADDRESS):
        client.held_marks(name, derived, now)
    return value, derived


def route_names(listener: listener_pb2.Listener) -> set[str]:
    managers = [listener.api_listener.api_listener] if listener.HasField("api_listener") else [
        f.typed_config for chain in listener.filter_chains for f in chain.filters
        if f.typed_config.type_url.endswith("HttpConnectionManager")]
    names = set()
    for packed in managers:
        hcm = hcm_pb2.HttpConnectionManager()
        packed.Unpack(hcm)
        if hcm.HasField("rds"):
            names.add(hcm.rds.route_config_name)
    return names


def route_clusters(route_config: route_pb2.RouteConfiguration) -> set[str]:
    names = set()
    for host in route_config.virtual_hosts:
        for route in host.routes:
            if route.route.cluster:
                names.add(route.route.cluster)
            names.update(w.name for w in route.route.weighted_clusters.clusters)
    return names


def eds_name(cluster: cluster_pb2.Cluster) -> str | None:
    if cluster.type != cluster_pb2.Cluster.EDS:
        return None
    return cluster.eds_cluster_config.service_name or cluster.name


@dataclass
class ClientSpec:
    index: int
    kind: str  # "proxyless" | "envoy" | "delta" | "ztunnel"
    listeners: list[str]  # proxyless: the listener names it watches (its services)
    expected_clusters: int  # how many ClusterLoadAssignments (ztunnel: Addresses) make it fully configured
    node: str = ""  # ztunnel: its node's name
    report_held: bool = False  # its summary names what it holds, by type (for comparing with a real peer)


CONNECT_TIMEOUT = 20.0  # a TLS connection not ready by then is a failed stream, retried


@dataclass
class Secure:
    """How ztunnel clients (every client with `all_clients`) reach istiod's secure port: its address,
    and PEM files of the root and their certificate (chain; "{index}" stands for the client's index)
    and key."""

    addr: str
    root: str
    cert: str
    key: str
    all_clients: bool = False


@dataclass
class Client:
    spec: ClientSpec
    node: base_pb2.Node
    names: dict[str, set[str]] = field(default_factory=dict)  # SotW: subscribed names per type
    versions: dict[str, tuple[str, str]] = field(default_factory=dict)  # type -> (version, nonce)
    resources: dict[str, dict[str, Any]] = field(default_factory=lambda: defaultdict(dict))
    configured_at: float | None = None
    seen: dict[int, float] = field(default_factory=dict)  # mark -> first time held
    streams_failed: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # status -> count
    sent_node: bool = False
    answered: set[str] = field(default_factory=set)  # the types answered on this stream
    # Envoy-like: the clusters its route configurations name, and marks held of clusters none names yet.
    routed: set[str] = field(default_factory=set)
    unrouted: dict[int, str] = field(default_factory=dict)  # mark -> its cluster

    @property
    def envoy_like(self) -> bool:
        return self.spec.kind in ("envoy", "delta")

    def held_marks(self, cluster: str, marks: set[int], now: float) -> None:
        """Marks now held in `cluster`'s assignment: seen, or for an Envoy-like client seen once a
        route configuration it holds names the cluster (a new Service's virtual host comes in the
        port's route configuration, apart from its cluster and endpoints)."""
        for mark in marks:
            if self.envoy_like and cluster not in self.routed:
                self.unrouted.setdefault(mark, cluster)
            else:
                self.seen.setdefault(mark, now)

    def route_to(self, clusters: set[str], now: float) -> None:
        """The route configurations it holds now name `clusters` (Envoy-like clients)."""
        self.routed = clusters
        for mark, cluster in list(self.unrouted.items()):
            if cluster in clusters:
                self.seen.setdefault(mark, now)
                del self.unrouted[mark]

    def configured(self) -> bool:
        """Everything it asked for on the way to its endpoints held: assignments for all the mesh's
        clusters (ztunnel: Addresses, and its policies answered) and, for an Envoy-like client, every
        route configuration its listeners name."""
        if self.spec.kind == "ztunnel":
            return len(self.resources[ADDRESS]) >= self.spec.expected_clusters and {ADDRESS, AUTHORIZATION} <= self.answered
        def held(type_url: str) -> bool:
            return type_url in self.answered and self.names.get(type_url, set()) <= self.resources[type_url].keys()
        return (held(EDS) and len(self.resources[EDS]) >= self.spec.expected_clusters
                and (not self.envoy_like or held(RDS)))

    def settled(self) -> bool:
        """Whether every type asked for on this stream was answered, with every name asked for (a client
        the server closed and that reconnected late in a run may still be on its way)."""
        return all(type_url in self.answered and names <= self.resources.get(type_url, {}).keys()
                   for type_url, names in self.names.items())

    def subscribe(self, type_url: str, names: set[str]) -> tuple[set[str], set[str]]:
        """Ask for exactly `names` of `type_url` from now on (empty: wildcard, for CDS and LDS);
        returns (added, removed). What is no longer asked for is forgotten, as Envoy and gRPC do:
        neither protocol says more about it (SotW EDS and RDS responses may leave out what did
        not change, and delta sends no removal for what was unsubscribed)."""
        old = self.names.get(type_url, set())
        self.names[type_url] = names
        for name in old - names:
            self.resources[type_url].pop(name, None)
        return names - old, old - names

    def digest(self) -> str:
        """Of everything held: clients asking for the same, the same way, end with the same one."""
        digest = hashlib.sha256()
        for type_url in sorted(self.resources):
            for name, (value, _) in sorted(self.resources[type_url].items()):
                digest.update(b"%s\0%s\0%d\0%s" % (type_url.encode(), name.encode(), len(value), value))
        return digest.hexdigest()

    def enqueue(self, queue: asyncio.Queue[Any], request: Any) -> None:
        """Send a request; only the first of a stream carries the node."""
        if not self.sent_node:
            request.node.CopyFrom(self.node)
            self.sent_node = True
        queue.put_nowait(request)


async def drain(queue: asyncio.Queue[Any]) -> Any:
    """A stream's requests, as they are sent, until None: ended so, grpc's reader task ends with it."""
    while (request := await queue.get()) is not None:
        yield request


class Worker:
    def __init__(self, xds_addr: str, specs: list[ClientSpec], secure: Secure | None = None) -> None:
        self.xds_addr, self.secure = xds_addr, secure
        self.clients = [Client(spec, self._node(spec)) for spec in specs]
        self.traffic: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # tick -> [bytes, responses] received
        self.failure_details: dict[str, str] = {}  # status -> the first failed stream's message
        self.handshakes: list[float] = []  # seconds each TLS connection took to be ready

    @staticmethod
    def _node(spec: ClientSpec) -> base_pb2.Node:
        metadata = struct_pb2.Struct()
        ip = f"10.250.{spec.index >> 8 & 255}.{spec.index & 255}"
        if spec.kind == "ztunnel":  # as ztunnel's xds client builds it (src/xds/client.rs), CLUSTER_ID from its chart
            metadata.update({"NAME": f"ztunnel-{spec.index}", "NAMESPACE": "istio-system", "INSTANCE_IPS": ip,
                             "NODE_NAME": spec.node, "CLUSTER_ID": "Kubernetes"})
            return base_pb2.Node(id=f"ztunnel~{ip}~ztunnel-{spec.index}.istio-system~istio-system.svc.cluster.local",
                                 metadata=metadata)
        fields: dict[str, Any] = {"NAMESPACE": "bench"}
        if spec.kind == "proxyless":
            fields["GENERATOR"] = "grpc"
        else:  # a sidecar's pod labels, as istio-agent reports them: its own pod's
            fields["LABELS"] = {"app": f"client{spec.index}"}
        metadata.update(fields)
        return base_pb2.Node(id=f"sidecar~{ip}~client{spec.index}.bench~bench.svc.cluster.local", metadata=metadata)

    async def run_client(self, client: Client, stop: asyncio.Event) -> None:
        delay = 0.1
        while not stop.is_set():
            queue: asyncio.Queue[Any] = asyncio.Queue()
            try:
                if client.spec.kind in ("delta", "ztunnel"):
                    await self._delta_stream(client, queue)
                else:
                    await self._sotw_stream(client, queue)
            except grpc.aio.AioRpcError as e:
                client.streams_failed[e.code().name] += 1
                self.failure_details.setdefault(e.code().name, str(e.details()))
            finally:
                queue.put_nowait(None)
            client.names.clear()  # a new stream starts from nothing, as a restarted client does
            client.versions.clear()
            client.resources.clear()
            client.answered.clear()
            client.routed, client.unrouted = set(), {}
            client.sent_node = False
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))  # reconnect with jittered backoff
            delay = min(delay * 2, 5.0)

    # --- state of the world ---------------------------------------------------------------------

    async def _sotw_stream(self, client: Client, queue: asyncio.Queue[Any]) -> None:
        def send(type_url: str) -> None:
            version, nonce = client.versions.get(type_url, ("", ""))
            request = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=sorted(client.names[type_url]),
                                                     version_info=version, response_nonce=nonce)
            client.enqueue(queue, request)

        async with await self._connect(client) as channel:
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(drain(queue))
            first = [(LDS, set(client.spec.listeners))] if client.spec.kind == "proxyless" else [(CDS, set()), (LDS, set())]
            for type_url, names in first:
                client.subscribe(type_url, names)
                send(type_url)
            async for response in call:
                now = time.time()
                self._count(response.ByteSize(), now)
                client.answered.add(response.type_url)
                held = client.resources[response.type_url]
                previous = dict(held)
                if response.type_url in (LDS, CDS):  # the whole state; EDS and RDS may carry only what changed
                    held.clear()
                for packed in response.resources:
                    name = leading_name(packed.value)
                    held[name] = hold(client, response.type_url, name, packed.value, previous.get(name), now)
                client.versions[response.type_url] = (response.version_info, response.nonce)
                send(response.type_url)  # the ACK
                for type_url, names in self._follow(client, response.type_url, now).items():
                    if names != client.names.get(type_url):
                        client.subscribe(type_url, names)
                        send(type_url)

    # --- delta ----------------------------------------------------------------------------------

    async def _delta_stream(self, client: Client, queue: asyncio.Queue[Any]) -> None:
        def send(type_url: str, subscribe: set[str] = set(), unsubscribe: set[str] = set(), nonce: str = "") -> None:
            request = discovery_pb2.DeltaDiscoveryRequest(
                type_url=type_url, resource_names_subscribe=sorted(subscribe),
                resource_names_unsubscribe=sorted(unsubscribe), response_nonce=nonce)
            client.enqueue(queue, request)

        async with await self._connect(client) as channel:
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources(drain(queue))
            wildcard = (ADDRESS, AUTHORIZATION) if client.spec.kind == "ztunnel" else (CDS, LDS)  # ztunnel's order
            for type_url in wildcard:  # wildcard: an empty subscribe list
                client.subscribe(type_url, set())
                send(type_url)
            async for response in call:
                now = time.time()
                self._count(response.ByteSize(), now)
                client.answered.add(response.type_url)
                held = client.resources[response.type_url]
                for name in response.removed_resources:
                    held.pop(name, None)
                for resource in response.resources:
                    value = resource.resource.value
                    held[resource.name] = hold(client, response.type_url, resource.name, value, held.get(resource.name), now)
                send(response.type_url, nonce=response.nonce)  # the ACK
                for type_url, names in self._follow(client, response.type_url, now).items():
                    added, removed = client.subscribe(type_url, names)
                    if added or removed:
                        send(type_url, added, removed)

    # --- shared ---------------------------------------------------------------------------------

    async def _connect(self, client: Client) -> grpc.aio.Channel:
        """ztunnels (every client with `secure.all_clients`): the secure port with a workload certificate,
        as a real proxy connects; the connection is made here, timed, when it is TLS."""
        secure = self.secure
        if secure is None or (client.spec.kind != "ztunnel" and not secure.all_clients):  # Istio's own istiod: plaintext
            return grpc.aio.insecure_channel(self.xds_addr, options=CHANNEL_OPTIONS)
        cert = secure.cert.replace("{index}", str(client.spec.index))
        files = [open(path, "rb").read() for path in (secure.root, secure.key, cert)]
        channel = grpc.aio.secure_channel(secure.addr, grpc.ssl_channel_credentials(*files), options=CHANNEL_OPTIONS)
        # grpcio does not tell the handshake apart: TCP connect and TLS handshake together.
        started = time.monotonic()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                await channel.channel_ready()
        except TimeoutError:
            await channel.close()
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       f"no TLS connection within {CONNECT_TIMEOUT:g}s") from None
        self.handshakes.append(time.monotonic() - started)
        return channel

    def _follow(self, client: Client, type_url: str, now: float) -> dict[str, set[str]]:
        """The subscriptions that follow from what the client now holds of `type_url`."""
        held = client.resources[type_url]
        if type_url in FOLLOWS and (type_url != RDS or client.spec.kind == "proxyless"):
            return {FOLLOWS[type_url]: set().union(*(derived for _, derived in held.values()))}
        if type_url == RDS:  # Envoy-like: it asked for every cluster already
            client.route_to(set().union(*(derived for _, derived in held.values())), now)
        if client.configured_at is None and client.configured():
            client.configured_at = now
        return {}

    def _count(self, size: int, now: float) -> None:
        counts = self.traffic[int(now * TICKS)]
        counts[0] += size
        counts[1] += 1

    def summary(self) -> dict[str, Any]:
        return {
            "clients": [{"index": c.spec.index, "kind": c.spec.kind, "configured_at": c.configured_at,
                         "seen": c.seen, "streams_failed": dict(c.streams_failed), "state": c.digest(),
                         "settled": c.settled(),
                         "held": {t: sorted(r) for t, r in c.resources.items()} if c.spec.report_held else None}
                        for c in self.clients],
            "traffic": dict(self.traffic),
            "failure_details": self.failure_details,
            "cpu_s": time.process_time(),  # the generator's own CPU: is it the bottleneck?
            "handshakes": self.handshakes,
        }


async def serve(xds_addr: str, specs: list[ClientSpec], control: Any, go: Any, stop_flag: Any,
                secure: Secure | None = None) -> None:
    """Once `go` is set, run the clients until `stop_flag` is; tell `control` (a queue) progress, then the summary."""
    worker = Worker(xds_addr, specs, secure)
    control.put(("ready", None))
    while not go.is_set():  # all workers connect at once: the storm does not time process start-up
        await asyncio.sleep(0.005)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(worker.run_client(client, stop)) for client in worker.clients]
    reported_configured = False
    reported_marks: set[int] = set()
    while not stop_flag.is_set():
        await asyncio.sleep(0.1)
        if not reported_configured and all(c.configured_at for c in worker.clients):
            control.put(("configured", max(c.configured_at or 0 for c in worker.clients)))
            reported_configured = True
        # Which marks every client of this worker holds: the coordinator waits on them.
        if worker.clients:
            common = set.intersection(*(set(c.seen) for c in worker.clients)) - reported_marks
            for mark in common:
                control.put(("all-seen", mark))
            reported_marks |= common
    # The final states are compared: first let clients that are still catching up finish (briefly).
    settled_by = time.monotonic() + SETTLE_SECONDS
    while not all(c.settled() for c in worker.clients) and time.monotonic() < settled_by:
        await asyncio.sleep(0.1)
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    control.put(("summary", worker.summary()))


def main(xds_addr: str, specs: list[ClientSpec], control: Any, go: Any, stop_flag: Any,
         secure: Secure | None = None) -> None:
    asyncio.run(serve(xds_addr, specs, control, go, stop_flag, secure))

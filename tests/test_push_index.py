"""The push index never misses a watcher: over random subscribe/unsubscribe/change/disconnect
sequences, after each push what every client holds equals a fresh full generation for it.

Hand-written in-process clients (SotW and delta, proxyless and sidecar) on the real DiscoveryServer,
without a network, so hypothesis can run many sequences; the real clients are in test_push_burst.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from istiod.model.mesh import MeshConfig
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import generators_for
from istiod.xds.pusher import Pusher
from istiod.xds.server import DiscoveryServer

NS = "demo"
SERVICES = {"a": 80, "b": 81, "c": 82}  # different ports: a pod moving to another's address adds inbound ports
PODS = {"a-1": "a", "a-2": "a", "b-1": "b", "c-1": "c"}
IPS = ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4")
# A Service that comes and goes (op "new"), selecting a's pods (where the proxyless clients are): clients
# may watch it before it exists, and its endpoints add inbound listeners.
NEW, NEW_PORT = "d", 83
EXTERNAL = "outbound|443||ext.example.com"  # the ServiceEntry's host
CLUSTERS = [f"outbound|{p}|{subset}|{s}.{NS}.svc.cluster.local"
            for s, p in [*SERVICES.items(), (NEW, NEW_PORT)] for subset in ("", "v1", "v2")] + [EXTERNAL]
# Listeners by every spelling a client may use: FQDN, name.namespace, a bare name from the namespace.
LISTENERS = ([f"{s}.{NS}.svc.cluster.local:{p}" for s, p in SERVICES.items()]
             + [f"xds.istio.io/grpc/lds/inbound/{ip}:{p}" for ip in IPS for p in [*SERVICES.values(), NEW_PORT]]
             + [f"{NEW}:{NEW_PORT}", f"{NEW}.{NS}:{NEW_PORT}", f"a.{NS}:80", "ext.example.com:443"])
# Proxyless route configurations, and a sidecar's (by port).
ROUTES = ([f"outbound|{p}||{s}.{NS}.svc.cluster.local" for s, p in [*SERVICES.items(), (NEW, NEW_PORT)]]
          + [str(p) for p in SERVICES.values()])
NAMES = {types.CLUSTER: CLUSTERS, types.ENDPOINT: CLUSTERS, types.LISTENER: LISTENERS, types.ROUTE: ROUTES}
# (flavor, delta): proxyless clients pick their names; sidecars watch CDS and LDS wildcard.
CLIENTS = (("grpc", False), ("grpc", True), ("sidecar", False), ("sidecar", True))


def service(name: str, port: int, target: int | None = None) -> dict[str, Any]:
    return {"kind": "Service", "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"app": "a" if name == NEW else name},
                     "ports": [{"name": "grpc", "port": port, **({"targetPort": target} if target else {})}]}}


def pod(name: str, ip: str, version: str, account: str, ready: bool) -> dict[str, Any]:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": {"app": PODS[name], "version": version}},
            "spec": {"serviceAccountName": account, "containers": [{"ports": [{"containerPort": p} for p in SERVICES.values()]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]}}


A_HOST, B_HOST = f"a.{NS}.svc.cluster.local", f"b.{NS}.svc.cluster.local"
_JWKS = '{"keys": [{"kty": "oct", "k": "c2VjcmV0", "alg": "HS256"}]}'
# Istio config of every kind, in versions (op "config": apply one, or delete with None); each
# changes some types of some clients, and a push that missed one would leave them stale.
CONFIGS: dict[tuple[str, str], tuple[dict[str, Any], ...]] = {
    ("networking.istio.io/v1", "VirtualService"): (
        {"hosts": [A_HOST], "http": [{"route": [{"destination": {"host": A_HOST, "subset": "v1"}, "weight": 50},
                                                {"destination": {"host": B_HOST}, "weight": 50}]}]},
        {"hosts": [A_HOST], "http": [{"timeout": "3s", "route": [{"destination": {"host": B_HOST}}]}]}),
    ("networking.istio.io/v1", "DestinationRule"): (
        {"host": A_HOST, "subsets": [{"name": v, "labels": {"version": v}} for v in ("v1", "v2")]},
        # Only the endpoints of the subsets change (the clusters stay as they were).
        {"host": A_HOST, "subsets": [{"name": "v1", "labels": {"version": "v2"}}, {"name": "v2", "labels": {"version": "v1"}}]},
        {"host": A_HOST, "trafficPolicy": {"loadBalancer": {"consistentHash": {"httpHeaderName": "x-user"}},
                                           "tls": {"mode": "DISABLE"}},
         "subsets": [{"name": "v2", "labels": {"version": "v2"}}]},
        # Every host of the namespace, by a wildcard.
        {"host": f"*.{NS}.svc.cluster.local", "subsets": [{"name": "v1", "labels": {"version": "v1"}}]},
        # Locality LB: a's endpoints by the pods' version label, made per proxy locality and label.
        {"host": A_HOST, "trafficPolicy": {"outlierDetection": {"consecutive5xxErrors": 1},
                                           "loadBalancer": {"localityLbSetting": {"failoverPriority": ["version"]}}},
         "subsets": [{"name": "v1", "labels": {"version": "v1"}}]},
        # Not a's: only a's routes (through the VirtualService, to b) take its hashing.
        {"host": B_HOST, "trafficPolicy": {"loadBalancer": {"consistentHash": {"httpHeaderName": "x-user"}}}}),
    ("networking.istio.io/v1", "Sidecar"): (
        {"egress": [{"hosts": [f"./{A_HOST}"]}]},
        {"outboundTrafficPolicy": {"mode": "REGISTRY_ONLY"}, "egress": [{"hosts": ["./*"]}]}),
    ("networking.istio.io/v1", "Gateway"): (
        {"selector": {"istio": "ingressgateway"}, "servers": [{"port": {"number": 80, "name": "http", "protocol": "HTTP"},
                                                               "hosts": ["*"]}]},
        {"selector": {"istio": "ingressgateway"}, "servers": [{"port": {"number": 81, "name": "http", "protocol": "HTTP"},
                                                               "hosts": ["*"]}]}),
    ("networking.istio.io/v1", "ServiceEntry"): (
        {"hosts": ["ext.example.com"], "location": "MESH_EXTERNAL", "resolution": "DNS",
         "ports": [{"number": 443, "name": "tls", "protocol": "TLS"}]},
        {"hosts": ["ext.example.com"], "location": "MESH_INTERNAL", "resolution": "STATIC",
         "workloadSelector": {"labels": {"app": "b"}}, "ports": [{"number": 443, "name": "grpc", "protocol": "GRPC", "targetPort": 81}]},
        # Only its endpoints differ from the first: a DNS cluster carries them.
        {"hosts": ["ext.example.com"], "location": "MESH_EXTERNAL", "resolution": "DNS",
         "endpoints": [{"address": "other.example.com"}], "ports": [{"number": 443, "name": "tls", "protocol": "TLS"}]},
        # Its endpoints are WorkloadEntries: when one moves, only the endpoints change.
        {"hosts": ["ext.example.com"], "location": "MESH_INTERNAL", "resolution": "DNS",
         "workloadSelector": {"labels": {"app": "b"}}, "ports": [{"number": 443, "name": "tls", "protocol": "TLS"}]}),
    ("networking.istio.io/v1", "WorkloadEntry"): (
        {"address": "10.0.0.9", "labels": {"app": "b", "version": "v2"}, "serviceAccount": "vm"},
        {"address": "10.0.0.1", "labels": {"app": "c", "version": "v1"}}),
    ("security.istio.io/v1", "PeerAuthentication"): (
        {"mtls": {"mode": "STRICT"}},
        {"selector": {"matchLabels": {"app": "a"}}, "mtls": {"mode": "DISABLE"}}),
    ("security.istio.io/v1", "AuthorizationPolicy"): (
        {"selector": {"matchLabels": {"app": "a"}}, "action": "DENY", "rules": [{"to": [{"operation": {"paths": ["/x"]}}]}]},
        {"rules": [{"from": [{"source": {"principals": [f"cluster.local/ns/{NS}/sa/default"]}}]}]}),
    ("security.istio.io/v1", "RequestAuthentication"): (
        {"selector": {"matchLabels": {"app": "b"}}, "jwtRules": [{"issuer": "https://issuer.test", "jwks": _JWKS}]},
        {"jwtRules": [{"issuer": "https://other.test", "jwks": _JWKS}]}),
}
CONFIG_CHANGES = [(kind, version) for kind, versions in sorted(CONFIGS.items()) for version in (*range(len(versions)), None)]
DESTINATION_RULE = ("networking.istio.io/v1", "DestinationRule")
VIRTUAL_SERVICE = ("networking.istio.io/v1", "VirtualService")


def config(kind: tuple[str, str], version: int) -> dict[str, Any]:
    return {"apiVersion": kind[0], "kind": kind[1], "metadata": {"name": "changing", "namespace": NS},
            "spec": CONFIGS[kind][version]}


class FakeContext:
    """What DiscoveryServer.stream uses of a grpc.aio.ServicerContext."""

    def __init__(self, responses: asyncio.Queue[Any]) -> None:
        self.responses = responses
        self.code = grpc.StatusCode.OK

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def send_initial_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        pass

    async def write(self, response: Any) -> None:
        self.responses.put_nowait(response)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        pass


@dataclass
class Client:
    """A client that ACKs every response and holds what it was sent, per type, by name."""

    flavor: str
    delta: bool
    ip: str
    pod: str
    requests: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    responses: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    held: dict[str, dict[str, bytes]] = field(default_factory=dict)
    watching: dict[str, list[str] | None] = field(default_factory=dict)
    nonces: dict[str, str] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    first: bool = True
    connected: bool = False

    @property
    def node_id(self) -> str:
        return f"sidecar~{self.ip}~{self.pod}.{NS}~{NS}.svc.cluster.local"

    def start(self, server: DiscoveryServer) -> None:
        async def requests() -> AsyncIterator[Any]:
            while (request := await self.requests.get()) is not None:
                yield request

        self.requests, self.responses = asyncio.Queue(), asyncio.Queue()
        method = server.DeltaAggregatedResources if self.delta else server.StreamAggregatedResources
        self.connected = True
        self.task = asyncio.create_task(method(requests(), FakeContext(self.responses)))  # type: ignore[arg-type]

    def stop(self) -> None:
        self.requests.put_nowait(None)
        self.connected = False
        self.held, self.watching, self.nonces, self.first = {}, {}, {}, True

    def _node(self, request: Any) -> None:
        if self.first:
            metadata = struct_pb2.Struct()
            metadata.update({"NAMESPACE": NS, **({"GENERATOR": "grpc"} if self.flavor == "grpc" else {})})
            request.node.CopyFrom(base_pb2.Node(id=self.node_id, metadata=metadata))
            self.first = False

    def subscribe(self, type_url: str, names: list[str] | None) -> None:
        old = self.watching.get(type_url, ...)
        if old is None or (not names and (old is ... or not self.delta and not self.nonces.get(type_url))):
            # A request without names that answers nothing opens a wildcard watch, which stays so here.
            names = None
        self.watching[type_url] = names
        if self.delta:
            request = discovery_pb2.DeltaDiscoveryRequest(type_url=type_url)
            if old is ...:
                request.resource_names_subscribe.extend(names or [])
            else:
                request.resource_names_subscribe.extend(n for n in names or () if n not in (old or ()))
                gone = [n for n in old or () if n not in (names or ())]
                request.resource_names_unsubscribe.extend(gone)
                for name in gone:
                    self.held.get(type_url, {}).pop(name, None)
        else:
            request = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names or [])
            if old is not ...:
                held = self.held.get(type_url, {})
                request.response_nonce = self.nonces.get(type_url, "")
                for name in [n for n in held if names is not None and n not in names]:
                    del held[name]
        self._node(request)
        self.requests.put_nowait(request)

    def pump(self) -> bool:
        """Applies and ACKs what arrived; whether anything did."""
        moved = False
        while not self.responses.empty():
            moved = True
            # The bytes gRPC would send, parsed as the client would.
            message = discovery_pb2.DeltaDiscoveryResponse if self.delta else discovery_pb2.DiscoveryResponse
            response = message.FromString(self.responses.get_nowait())
            held = self.held.setdefault(response.type_url, {})
            if self.delta:
                watching = self.watching.get(response.type_url)
                for resource in response.resources:
                    if watching is None or resource.name in watching:  # else: unsubscribed since it was sent
                        held[resource.name] = resource.resource.value
                for name in response.removed_resources:
                    held.pop(name, None)
                ack = discovery_pb2.DeltaDiscoveryRequest(type_url=response.type_url, response_nonce=response.nonce)
            else:
                if response.type_url in (types.LISTENER, types.CLUSTER):
                    held.clear()  # state of the world: what is absent is gone
                for any_ in response.resources:
                    held[_name(response.type_url, any_)] = any_.value
                self.nonces[response.type_url] = response.nonce
                watching = self.watching.get(response.type_url)
                ack = discovery_pb2.DiscoveryRequest(type_url=response.type_url, response_nonce=response.nonce,
                                                     version_info=response.version_info, resource_names=watching or [])
            self.requests.put_nowait(ack)
        return moved

    def check(self, server: DiscoveryServer) -> None:
        """What it holds of each type is what a full generation from the current snapshot gives."""
        (connection,) = [c for c in server.connections.values() if c.proxy.id == self.node_id]
        snapshot = server._snapshot()
        for type_url, names in self.watching.items():
            generator = generators_for(connection.proxy)[type_url]
            fresh = {r.name: r.value for r in generator(snapshot, connection.proxy, names, ResourceCache())}
            held = self.held.get(type_url, {})
            if type_url in (types.ENDPOINT, types.ROUTE) and not self.delta:
                # SotW EDS/RDS: absence is not deletion; a client drops what no cluster/listener names.
                held = {n: v for n, v in held.items() if n in fresh}
            assert held == fresh, (self.flavor, self.delta, types.short_name(type_url), sorted(held), sorted(fresh))


MESSAGES = {types.CLUSTER: cluster_pb2.Cluster, types.ENDPOINT: endpoint_pb2.ClusterLoadAssignment,
            types.LISTENER: listener_pb2.Listener, types.ROUTE: route_pb2.RouteConfiguration}


def _name(type_url: str, any_: Any) -> str:
    message = MESSAGES[type_url]()
    message.ParseFromString(any_.value)
    return message.cluster_name if type_url == types.ENDPOINT else message.name


def _idle(server: DiscoveryServer) -> bool:
    return all(not c._push_queued and c._request is None for c in server.connections.values())


async def settle(server: DiscoveryServer, clients: list[Client]) -> None:
    quiet = 0
    for _ in range(2000):
        await asyncio.sleep(0)
        moved = any([c.pump() for c in clients])
        quiet = 0 if moved or not _idle(server) else quiet + 1
        if quiet >= 20:
            return
    raise AssertionError("the server and its clients did not settle")


Op = tuple[Any, ...]
ops = st.lists(st.one_of(
    st.tuples(st.just("subscribe"), st.integers(0, len(CLIENTS) - 1), st.sampled_from(sorted(NAMES)),
              st.lists(st.sampled_from(CLUSTERS + LISTENERS + ROUTES), max_size=6, unique=True)),
    st.tuples(st.just("pod"), st.sampled_from(sorted(PODS)), st.sampled_from(IPS), st.sampled_from(("v1", "v2")),
              st.sampled_from(("default", "other")), st.booleans()),
    # Several pushes before the connections run: their scopes coalesce (a service's push is of everything).
    st.tuples(st.just("burst"), st.lists(st.one_of(
        st.tuples(st.sampled_from(sorted(PODS)), st.sampled_from(IPS)),
        st.tuples(st.sampled_from(sorted(SERVICES)), st.sampled_from((0, 10)))), max_size=4)),
    st.tuples(st.just("service"), st.sampled_from(sorted(SERVICES)), st.sampled_from((0, 10))),
    st.tuples(st.just("config"), st.sampled_from(CONFIG_CHANGES)),
    st.tuples(st.just("new"), st.sampled_from((None, 81, 80))),  # gone, or with that target port
    st.tuples(st.just("pod gone"), st.sampled_from(sorted(PODS))),  # c's only pod: c has no endpoints left
    st.tuples(st.just("disconnect"), st.integers(0, len(CLIENTS) - 1)),
), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
# A Service that goes takes its pods' inbound listeners on its target port, whoever watches its own.
@example([("new", 81), ("subscribe", 0, types.LISTENER, ["xds.istio.io/grpc/lds/inbound/10.0.0.1:81"]), ("new", None)])
# A rule for every host by a wildcard goes; a rule for b changes a's routes, which the VirtualService sends to b.
@example([("config", (DESTINATION_RULE, 3)), ("config", (DESTINATION_RULE, None))])
@example([("config", (VIRTUAL_SERVICE, 1)), ("config", (DESTINATION_RULE, None)), ("config", (DESTINATION_RULE, 4))])
def test_pushed_state_equals_a_fresh_full_generation(sequence: list[Op]) -> None:
    asyncio.run(_run(sequence))


async def _run(sequence: list[Op]) -> None:
    store = Store()
    for name, port in SERVICES.items():
        store.apply(service(name, port))
    store.apply(config(DESTINATION_RULE, 0))
    for (name, ip) in zip(PODS, IPS):
        store.apply(pod(name, ip, "v1", "default", True))
    pusher = Pusher(store, mesh=MeshConfig(mtls=True))
    server = DiscoveryServer(lambda: pusher.snapshot)
    pusher.subscribe(server.on_push)
    pusher.publish(full=True)
    server.ready = True
    clients = [Client(flavor, delta, ip, name) for (flavor, delta), name, ip in zip(CLIENTS, PODS, IPS)]
    try:
        for client in clients:
            _connect(client, server)
        await settle(server, clients)
        for op in sequence:
            if op[0] == "subscribe":
                client = clients[op[1]]
                if not client.connected:
                    _connect(client, server)
                type_url, names = op[2], [n for n in op[3] if n in NAMES[op[2]]]
                if client.flavor == "sidecar" and type_url in (types.CLUSTER, types.LISTENER):
                    continue  # Envoy watches those as wildcards
                client.subscribe(type_url, names)
            elif op[0] == "pod":
                store.apply(pod(*op[1:]))
                pusher.publish()
            elif op[0] == "burst":
                for name, value in op[1]:
                    store.apply(service(name, SERVICES[name] + value) if name in SERVICES
                                else pod(name, value, "v2", "default", True))
                    pusher.publish()
            elif op[0] == "service":
                store.apply(service(op[1], SERVICES[op[1]] + op[2]))
                pusher.publish()
            elif op[0] == "pod gone":
                store.delete(ObjectKey("Pod", NS, op[1]))
                pusher.publish()
            elif op[0] == "new":
                if op[1] is None:
                    store.delete(ObjectKey("Service", NS, NEW))
                else:
                    store.apply(service(NEW, NEW_PORT, op[1]))
                pusher.publish()
            elif op[0] == "config":
                kind, version = op[1]
                if version is None:
                    store.delete(ObjectKey(kind[1], NS, "changing"))
                else:
                    store.apply(config(kind, version))
                pusher.publish()
            elif op[0] == "disconnect" and clients[op[1]].connected:
                clients[op[1]].stop()
                await settle(server, clients)
            await settle(server, clients)
            for client in clients:
                if client.connected:
                    assert client.task is not None and not client.task.done(), client.task and client.task.result()
                    client.check(server)
    finally:
        for client in clients:
            if client.connected:
                client.stop()
        await asyncio.gather(*(c.task for c in clients if c.task is not None), return_exceptions=True)
    assert not server.connections
    assert not any(server.watchers._watching) and not any(server.watchers._by_key.values())


def _connect(client: Client, server: DiscoveryServer) -> None:
    """Every type watched from the start, as real clients do, so that each kind of change meets a watcher."""
    client.task = None
    client.start(server)
    if client.flavor == "sidecar":
        client.subscribe(types.CLUSTER, None)
        client.subscribe(types.LISTENER, None)
        client.subscribe(types.ENDPOINT, CLUSTERS[:2])
        client.subscribe(types.ROUTE, [str(SERVICES["a"])])
    else:
        client.subscribe(types.LISTENER, [LISTENERS[0], f"xds.istio.io/grpc/lds/inbound/{client.ip}:{SERVICES['a']}",
                                          f"xds.istio.io/grpc/lds/inbound/{client.ip}:{SERVICES['b']}", f"{NEW}:{NEW_PORT}"])
        client.subscribe(types.ROUTE, ROUTES[:1])
        client.subscribe(types.CLUSTER, CLUSTERS[:2])
        client.subscribe(types.ENDPOINT, CLUSTERS[:2])

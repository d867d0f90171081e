"""The ADS protocol in-process, with a hand-written stream client (the real clients are in
test_proxyless_grpc.py): readiness, node checks, ACK/NACK, stale nonces, targeted pushes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2
from google.rpc import status_pb2

from istiod.sources.store import Store
from istiod.xds import types, wire
from istiod.xds.pusher import Pusher
from istiod.xds.server import DiscoveryServer, add_to_server

NODE = "sidecar~127.0.0.1~client-1.demo~demo.svc.cluster.local"


def service(name: str, port: int = 80) -> dict:
    return {"kind": "Service", "metadata": {"name": name, "namespace": "demo"},
            "spec": {"selector": {"app": name}, "ports": [{"name": "grpc", "port": port}]}}


def pod(name: str, app: str, ip: str, port: int = 80) -> dict:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "demo", "labels": {"app": app}},
            "spec": {"containers": [{"ports": [{"containerPort": port}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


class Stream:
    """A minimal ADS client: send requests, read responses with a timeout."""

    def __init__(self, stub: ads_pb2_grpc.AggregatedDiscoveryServiceStub, node_id: str = NODE) -> None:
        self.node_id = node_id
        self.requests: asyncio.Queue[discovery_pb2.DiscoveryRequest] = asyncio.Queue()
        self.call = stub.StreamAggregatedResources(self._requests())
        self.first = True
        self._pending: asyncio.Future[discovery_pb2.DiscoveryResponse] | None = None

    async def _requests(self) -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while True:
            yield await self.requests.get()

    def send(self, type_url: str, names: list[str] = [], nonce: str = "", version: str = "", error: str = "") -> None:
        request = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names, response_nonce=nonce,
                                                 version_info=version)
        if self.first:
            metadata = struct_pb2.Struct()
            metadata.update({"GENERATOR": "grpc", "NAMESPACE": "demo"})
            request.node.CopyFrom(base_pb2.Node(id=self.node_id, metadata=metadata))
            self.first = False
        if error:
            request.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
        self.requests.put_nowait(request)

    def _next(self) -> asyncio.Future[discovery_pb2.DiscoveryResponse]:
        """One outstanding read at a time, so a read that timed out keeps its place in line."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.call.read())
        return self._pending

    async def receive(self, timeout: float = 2.0) -> discovery_pb2.DiscoveryResponse:
        response = await asyncio.wait_for(asyncio.shield(self._next()), timeout)
        self._pending = None
        return response

    async def nothing(self, timeout: float = 0.3) -> None:
        done, _ = await asyncio.wait({self._next()}, timeout=timeout)
        assert not done, f"unexpected response: {self._pending.result() if done else ''}"


@pytest.fixture
async def ads() -> AsyncIterator[tuple[Store, Pusher, DiscoveryServer, ads_pb2_grpc.AggregatedDiscoveryServiceStub]]:
    store = Store()
    for obj in (service("a"), service("b"), pod("a-1", "a", "10.0.0.1"), pod("b-1", "b", "10.0.0.2")):
        store.apply(obj)
    pusher = Pusher(store, debounce_after=0.01, debounce_max=0.05)
    discovery = DiscoveryServer(lambda: pusher.snapshot)
    pusher.subscribe(discovery.on_push)
    server = grpc.aio.server()
    add_to_server(discovery, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    task = asyncio.create_task(pusher.run())
    pusher.publish(full=True)
    discovery.ready = True
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield store, pusher, discovery, ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
    finally:
        await channel.close()
        task.cancel()
        await server.stop(None)


async def test_refuses_until_ready_and_bad_nodes(ads) -> None:
    store, pusher, discovery, stub = ads
    discovery.ready = False
    stream = Stream(stub)
    stream.send(types.CLUSTER)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stream.receive()
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error.value.details() == "server is not ready to serve discovery information"
    discovery.ready = True
    for node_id, message in (("", "the first request must carry node.id"),
                             ("sidecar~x~p.ns~d", "node ID 'sidecar~x~p.ns~d': 'x' is not an IP address")):
        stream = Stream(stub, node_id)
        stream.send(types.CLUSTER)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stream.receive()
        assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


async def test_ack_nack_stale_nonce_and_subscription_change(ads, caplog: pytest.LogCaptureFixture) -> None:
    store, pusher, discovery, stub = ads
    stream = Stream(stub)
    cluster_a = "outbound|80||a.demo.svc.cluster.local"
    stream.send(types.CLUSTER, [cluster_a, "outbound|80||missing.demo.svc.cluster.local"])
    response = await stream.receive()
    assert [r.type_url for r in response.resources] == [types.CLUSTER]  # the missing one is absent
    (connection,) = discovery.connections.values()
    watched = connection.watched[types.CLUSTER]
    assert watched.nonce_sent == response.nonce and watched.nonce_acked == ""

    stream.send(types.CLUSTER, [cluster_a, "outbound|80||missing.demo.svc.cluster.local"], response.nonce, response.version_info)
    await stream.nothing()
    assert watched.nonce_acked == response.nonce and watched.version_acked == response.version_info

    with caplog.at_level(logging.WARNING):
        stream.send(types.CLUSTER, [cluster_a], response.nonce, response.version_info, error="lb_policy not supported")
        await stream.nothing()
    assert watched.last_error == "lb_policy not supported" and watched.nacked_nonce == response.nonce
    assert caplog.text.count("ads NACK") == 1 and "lb_policy not supported" in caplog.text

    stream.send(types.CLUSTER, [cluster_a], "stale-nonce")
    await stream.nothing()

    stream.send(types.ENDPOINT, [cluster_a])
    endpoints = await stream.receive()
    assert endpoints.type_url == types.ENDPOINT and len(endpoints.resources) == 1
    stream.send(types.ENDPOINT, [cluster_a, "outbound|80||b.demo.svc.cluster.local"], endpoints.nonce)
    assert len((await stream.receive()).resources) == 2  # names changed with the ACK: answered


def test_names_key_tells_acks_of_the_same_names_apart_from_others() -> None:
    def key(names: list[str], version: str = "v1", nonce: str = "n1", error: str = "") -> int | None:
        request = discovery_pb2.DiscoveryRequest(version_info=version, resource_names=names, type_url=types.ENDPOINT,
                                                 response_nonce=nonce)
        if error:
            request.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
        return wire.names_key(request.SerializeToString(), request)

    names = [f"outbound|80||svc-{i}.demo.svc.cluster.local" for i in range(100)]
    assert key(names) is not None and key(names) == key(names, "v2", "n2") == key(names, "", "a-much-longer-nonce")
    assert key(names) != key([*names[:-1], "outbound|80||other.demo.svc.cluster.local"])
    assert key(names) != key(names[::-1])
    assert key(names, nonce="") is None  # not an answer to a response
    assert key(names, error="rejected") is None  # a NACK: its error comes after the nonce


async def test_an_ack_naming_other_resources_as_many_as_before_is_answered(ads) -> None:
    store, pusher, discovery, stub = ads
    stream = Stream(stub)
    cluster_a, cluster_b = "outbound|80||a.demo.svc.cluster.local", "outbound|80||b.demo.svc.cluster.local"
    stream.send(types.ENDPOINT, [cluster_a])
    endpoints = await stream.receive()
    stream.send(types.ENDPOINT, [cluster_a], endpoints.nonce, endpoints.version_info)
    await stream.nothing()
    (connection,) = discovery.connections.values()
    watched = connection.watched[types.ENDPOINT]
    assert watched.names_key is not None and watched.names == [cluster_a]
    stream.send(types.ENDPOINT, [cluster_a], endpoints.nonce, endpoints.version_info)  # the same ACK again
    await stream.nothing()
    stream.send(types.ENDPOINT, [cluster_b], endpoints.nonce, endpoints.version_info)
    answer = await stream.receive()
    assert [endpoint_pb2.ClusterLoadAssignment.FromString(r.value).cluster_name for r in answer.resources] == [cluster_b]
    assert watched.names == [cluster_b]


async def test_push_goes_only_where_resources_changed(ads) -> None:
    store, pusher, discovery, stub = ads
    streams = {}
    for name in ("a", "b"):
        stream = Stream(stub, f"sidecar~127.0.0.1~{name}-client.demo~demo.svc.cluster.local")
        stream.send(types.ENDPOINT, [f"outbound|80||{name}.demo.svc.cluster.local"])
        first = await stream.receive()
        stream.send(types.ENDPOINT, [f"outbound|80||{name}.demo.svc.cluster.local"], first.nonce, first.version_info)
        streams[name] = stream
    store.apply(pod("a-2", "a", "10.0.0.3"))
    update = await streams["a"].receive()
    assert update.type_url == types.ENDPOINT
    await streams["b"].nothing(0.5)
    assert discovery.cache.hits == 0  # b's connection, which watches no cluster of a, was not even woken


async def test_eds_carries_what_differs_from_what_was_sent_or_after_a_nack_from_what_was_acked(ads) -> None:
    store, pusher, discovery, stub = ads
    stream = Stream(stub)
    names = [f"outbound|80||{s}.demo.svc.cluster.local" for s in ("a", "b")]

    def carried(response: discovery_pb2.DiscoveryResponse) -> set[str]:
        return {endpoint_pb2.ClusterLoadAssignment.FromString(r.value).cluster_name for r in response.resources}

    stream.send(types.ENDPOINT, names)
    first = await stream.receive()
    stream.send(types.ENDPOINT, names, first.nonce, first.version_info)
    store.apply(pod("a-1", "a", "10.0.0.11"))
    assert carried(second := await stream.receive()) == {names[0]}
    # Not ACKed yet (under churn the next push often overtakes the ACK): the next carries only b.
    store.apply(pod("b-1", "b", "10.0.0.12"))
    assert carried(third := await stream.receive()) == {names[1]}
    stream.send(types.ENDPOINT, names, second.nonce, second.version_info)  # stale now: ignored
    # A NACK: the client holds what it ACKed last, so b goes again with the next change of a.
    stream.send(types.ENDPOINT, names, third.nonce, first.version_info, error="rejected")
    await stream.nothing()
    store.apply(pod("a-1", "a", "10.0.0.21"))
    assert carried(await stream.receive()) == set(names)


async def test_a_push_of_endpoints_waits_for_the_answer_to_the_previous_and_carries_what_changed_meanwhile(ads) -> None:
    store, pusher, discovery, stub = ads
    stream = Stream(stub)
    names = [f"outbound|80||{s}.demo.svc.cluster.local" for s in ("a", "b")]

    def held(response: discovery_pb2.DiscoveryResponse) -> dict[str, set[str]]:
        assignments = [endpoint_pb2.ClusterLoadAssignment.FromString(r.value) for r in response.resources]
        return {a.cluster_name: {e.endpoint.address.socket_address.address for g in a.endpoints for e in g.lb_endpoints}
                for a in assignments}

    stream.send(types.ENDPOINT, names)
    first = await stream.receive()
    stream.send(types.ENDPOINT, names, first.nonce, first.version_info)
    store.apply(pod("a-1", "a", "10.0.0.11"))
    second = await stream.receive()
    assert held(second) == {names[0]: {"10.0.0.11"}}
    # Not answered yet: the changes wait, and go together once it is.
    store.apply(pod("b-1", "b", "10.0.0.12"))
    await asyncio.sleep(0.1)
    store.apply(pod("a-1", "a", "10.0.0.21"))
    await stream.nothing(0.3)
    stream.send(types.ENDPOINT, names, second.nonce, second.version_info)
    third = await stream.receive(0.5)
    assert held(third) == {names[0]: {"10.0.0.21"}, names[1]: {"10.0.0.12"}}
    # A client that never answers gets them all the same, a moment later (connection.ANSWER_WAIT).
    store.apply(pod("b-1", "b", "10.0.0.22"))
    assert held(await stream.receive(3)) == {names[1]: {"10.0.0.22"}}
    store.apply(pod("b-1", "b", "10.0.0.32"))
    assert held(await stream.receive(3)) == {names[1]: {"10.0.0.32"}}

"""The delta steps on their own: subscriptions, what a reconnecting client holds, what a response carries."""

from __future__ import annotations

import grpc
import pytest
from envoy.service.discovery.v3 import discovery_pb2

from istiod.model.snapshot import Snapshot
from istiod.xds import delta, types
from istiod.xds.cache import Resource
from istiod.xds.connection import Held, StreamClosed, WatchedResource

SNAPSHOT = Snapshot("v1")


def request(subscribe: tuple[str, ...] = (), unsubscribe: tuple[str, ...] = (),
            versions: dict[str, str] | None = None) -> discovery_pb2.DeltaDiscoveryRequest:
    return discovery_pb2.DeltaDiscoveryRequest(
        type_url=types.CLUSTER, resource_names_subscribe=subscribe, resource_names_unsubscribe=unsubscribe,
        initial_resource_versions=versions or {})


def resource(name: str, value: bytes = b"v") -> Resource:
    return Resource(name, types.CLUSTER, name.encode() + value)


@pytest.mark.parametrize("first", [(), ("*",)], ids=["empty", "star"])
def test_wildcard_is_an_empty_first_subscription_or_a_star(first: tuple[str, ...]) -> None:
    watched, changed = delta.subscribe(None, request(first), 10)
    assert watched.names is None and changed
    # Later named subscriptions add nothing to a wildcard; unsubscribing `*` leaves explicit names only.
    assert delta.subscribe(watched, request(("a",)), 10)[1] is False
    watched, changed = delta.subscribe(watched, request(unsubscribe=("*",)), 10)
    assert watched.names == [] and changed


def test_unsubscribed_names_are_forgotten_not_removed() -> None:
    watched, _ = delta.subscribe(None, request(("a", "b")), 10)
    assert delta.respond(watched, SNAPSHOT, [resource("a"), resource("b")], always=True) is not None
    watched, changed = delta.subscribe(watched, request(unsubscribe=("b",)), 10)
    assert changed and watched.names == ["a"] and set(watched.sent) == {"a"}
    assert delta.respond(watched, SNAPSHOT, [resource("a")]) is None  # nothing to send, nothing removed


def test_a_response_carries_what_changed_and_what_left() -> None:
    watched = WatchedResource(types.CLUSTER, None)
    delta.respond(watched, SNAPSHOT, [resource("a"), resource("b"), resource("c")], always=True)
    outgoing = delta.respond(watched, SNAPSHOT, [resource("a"), resource("b", b"new")])
    assert outgoing is not None
    response = discovery_pb2.DeltaDiscoveryResponse.FromString(bytes(outgoing))
    assert [r.name for r in response.resources] == ["b"] and list(response.removed_resources) == ["c"]
    assert response.resources[0].version == resource("b", b"new").version


def test_a_push_of_some_endpoints_compares_only_those_and_removes_nothing() -> None:
    watched = WatchedResource(types.ENDPOINT, ["a", "b", "c"])
    delta.respond(watched, SNAPSHOT, [resource("a"), resource("b"), resource("c")], always=True)
    assert isinstance(watched.sent, Held)
    fresh = [resource("a"), resource("b", b"new")]  # "a" generated again, unchanged
    after = watched.sent.updated(fresh)
    outgoing = delta.respond(watched, SNAPSHOT, fresh, held=after)
    assert outgoing is not None
    response = discovery_pb2.DeltaDiscoveryResponse.FromString(bytes(outgoing))
    assert [r.name for r in response.resources] == ["b"] and not response.removed_resources
    assert watched.sent is after and set(after) == {"a", "b", "c"}


def test_a_reconnect_gets_only_what_differs_from_the_versions_it_holds() -> None:
    current = [resource("same"), resource("changed", b"new"), resource("new")]
    held = {"same": resource("same").version, "changed": resource("changed").version,
            "gone": "0123"}
    watched, _ = delta.subscribe(None, request(versions=held), 10)
    delta.held(watched, current, held)
    outgoing = delta.respond(watched, SNAPSHOT, current, always=True)
    assert outgoing is not None
    response = discovery_pb2.DeltaDiscoveryResponse.FromString(bytes(outgoing))
    assert sorted(r.name for r in response.resources) == ["changed", "new"]
    assert list(response.removed_resources) == ["gone"]


def test_too_many_names_end_the_stream() -> None:
    with pytest.raises(StreamClosed) as closed:
        delta.subscribe(None, request(("a", "b", "c")), 2)
    assert closed.value.closed.code == grpc.StatusCode.INVALID_ARGUMENT


def test_connections_holding_the_same_are_told_the_same_difference_worked_out_once() -> None:
    """Every ztunnel holds the same table and is given the same next one: the difference is made once."""
    a, b, c = (Resource(n, types.ADDRESS, n.encode()) for n in "abc")
    b2 = Resource("b", types.ADDRESS, b"b2")
    held = Held.of([a, b, c])
    first, second = (WatchedResource(types.ADDRESS, None) for _ in range(2))
    first.sent = second.sent = held
    current = [a, b2, Resource("d", types.ADDRESS, b"d")]
    one = delta.respond(first, Snapshot("v2"), current)
    other = delta.respond(second, Snapshot("v2"), list(current))
    assert one is not None and other is not None
    assert [r.name for r in one.resources] == ["b", "d"] and one.resources is other.resources
    assert first.sent is second.sent and set(first.sent) == {"a", "b", "d"}
    assert discovery_pb2.DeltaDiscoveryResponse.FromString(one.header).removed_resources == ["c"]

"""Per-connection state that connections share (istiod/xds/connection.Held): one object for the same
resources, never changed in place, so one connection's change never shows in another's."""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

from envoy.service.discovery.v3 import discovery_pb2

from istiod.xds import connection, delta, types
from istiod.xds.cache import Resource
from istiod.xds.connection import Held, WatchedResource

SNAPSHOT: Any = SimpleNamespace(version="v1")  # respond reads only the version


def clusters(*names: str) -> list[Resource]:
    return [Resource(n, types.CLUSTER, n.encode()) for n in names]


def test_connections_sent_the_same_resources_share_one_held() -> None:
    resources = clusters("a", "b")
    first, second = Held.of(resources), Held.of(list(resources))
    assert first is second and dict(first) == {"a": resources[0], "b": resources[1]}
    assert Held.of(clusters("a", "b")) is not first  # other objects: another Held
    key = tuple(map(id, resources))
    del first, second
    gc.collect()
    assert key not in connection._held  # gone with the last holder


def test_a_delta_unsubscribe_leaves_the_other_connections_held_alone() -> None:
    current = clusters("a", "b")
    one, other = (WatchedResource(types.CLUSTER, ["a", "b"]) for _ in range(2))
    for watched in (one, other):
        assert delta.respond(watched, SNAPSHOT, current, always=True) is not None
        delta.acked(watched, discovery_pb2.DeltaDiscoveryRequest(response_nonce=watched.nonce_sent))
    assert one.sent is other.sent is other.acked
    request = discovery_pb2.DeltaDiscoveryRequest(type_url=types.CLUSTER, resource_names_unsubscribe=["a"])
    delta.subscribe(one, request, 100)
    assert set(one.sent) == {"b"}
    assert set(other.sent) == set(other.acked) == {"a", "b"}

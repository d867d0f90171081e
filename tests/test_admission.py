"""Admission of new ADS streams: a connect storm against a real istiod ends every stream served or
told RESOURCE_EXHAUSTED with a reason, none cancelled by gRPC core's backlog limits.

The storm's clients are hand-written (many streams over a few connections, so more calls wait in
gRPC core than its default pending limit of 1000); the real gRPC clients are in test_proxyless_grpc.py.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2

from istiod.xds import admission, types
from istiod.xds.admission import RateLimited, RequestLimiter
from tests.conftest import render
from tests.peers import Istiod

STREAMS = 3000  # enough for gRPC core's default limits to drop some here (it did before its options were set)
CONNECTIONS = 10


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(admission.time, "monotonic", clock)
    return clock


def test_limiter_paces_streams_and_refuses_those_that_would_wait_over_a_second(clock: Clock) -> None:
    limiter = RequestLimiter(10)  # burst 1, as istiod's rate.NewLimiter(limit, 1)
    waits = [limiter.reserve() for _ in range(11)]
    assert waits == pytest.approx([0.0, *(0.1 * i for i in range(1, 11))])
    with pytest.raises(RateLimited, match="request rate limit exceeded: more than 10 new streams a second"):
        limiter.reserve()
    clock.now += 0.5  # tokens come back at the rate; a refused stream took none
    assert limiter.reserve() == pytest.approx(0.6)
    clock.now += 60  # an idle limiter holds no more than its burst
    assert [limiter.reserve() for _ in range(2)] == pytest.approx([0.0, 0.1])


def test_zero_rate_is_no_limit(clock: Clock) -> None:
    limiter = RequestLimiter(0)
    assert all(limiter.reserve() == 0.0 for _ in range(10_000))


async def _open(stub: ads_pb2_grpc.AggregatedDiscoveryServiceStub, i: int) -> tuple[str, str]:
    """One proxyless stream asking for a listener: its first response, or the status it ended with."""
    metadata = struct_pb2.Struct()
    metadata.update({"GENERATOR": "grpc", "NAMESPACE": "demo"})
    node = base_pb2.Node(id=f"sidecar~10.1.{i >> 8}.{i & 255}~storm-{i}.demo~demo.svc.cluster.local", metadata=metadata)
    done = asyncio.Event()

    async def requests() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        yield discovery_pb2.DiscoveryRequest(node=node, type_url=types.LISTENER,
                                             resource_names=["echo.demo.svc.cluster.local:7070"])
        await done.wait()

    call = stub.StreamAggregatedResources(requests())
    try:
        response = await call.read()
        if response is grpc.aio.EOF:
            return "EOF", ""
        return "served", ""
    except grpc.aio.AioRpcError as error:
        return error.code().name, error.details() or ""
    finally:
        done.set()
        call.cancel()


async def _storm(address: str, streams: int = STREAMS) -> Counter[tuple[str, str]]:
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CONNECTIONS)]
    try:
        stubs = [ads_pb2_grpc.AggregatedDiscoveryServiceStub(c) for c in channels]
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(_open(stubs[i % CONNECTIONS], i) for i in range(streams))), 120)
        return Counter(outcomes)
    finally:
        for channel in channels:
            await channel.close()


@pytest.fixture
def storm_istiod(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> Callable[..., Istiod]:
    (mesh_dir / "echo.yaml").write_text(render("service.yaml", name="echo", namespace="demo", port=7070))
    return lambda *flags: start_istiod(mesh_dir, *flags)


async def test_storm_without_limit_serves_every_stream(storm_istiod: Callable[..., Istiod]) -> None:
    istiod = storm_istiod("--max-requests-per-second", "0")
    outcomes = await _storm(istiod.xds_address)
    assert outcomes == {("served", ""): STREAMS}


async def test_storm_past_the_rate_is_refused_with_resource_exhausted(storm_istiod: Callable[..., Istiod]) -> None:
    istiod = storm_istiod("--max-requests-per-second", "50")
    outcomes = await _storm(istiod.xds_address, 600)
    refused = ("RESOURCE_EXHAUSTED", "request rate limit exceeded: more than 50 new streams a second; "
                                     "retry later or connect to another replica")
    assert set(outcomes) == {("served", ""), refused}, outcomes  # some of each, nothing else
    assert "ads stream refused" in istiod.text()

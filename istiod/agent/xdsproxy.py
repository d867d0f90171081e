"""The agent's xDS proxy (pilot-agent's, on ./etc/istio/proxy/XDS): Envoy's ADS streams to istiod.

Each stream Envoy opens is forwarded on a new TLS connection to istiod's secure port, authenticated
as pilot-agent does: the workload certificate as the client certificate, and the service-account
token when it can be read. When istiod's side ends or cannot be reached, Envoy's stream ends with
istiod's status; Envoy redials the proxy with its own backoff and the proxy dials istiod afresh, so
the connection comes back without restarting Envoy, and istiod gets Envoy's full state again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from istiod.agent.agent import AgentError
from istiod.agent.health import ProbeResult
from istiod.agent.metrics import XDS_PROXY_REQUESTS, XDS_PROXY_RESPONSES
from istiod.xds import types

log = logging.getLogger(__name__)

# A mesh's CDS or EDS can pass gRPC's 4 MB default; pilot-agent takes any size from istiod too.
UPSTREAM_OPTIONS = [("grpc.max_receive_message_length", -1)]
Request = TypeVar("Request", discovery_pb2.DiscoveryRequest, discovery_pb2.DeltaDiscoveryRequest)
Response = TypeVar("Response", discovery_pb2.DiscoveryResponse, discovery_pb2.DeltaDiscoveryResponse)


class _Upstream:
    """One stream to istiod: its writes one at a time (Envoy's requests and the health reports)."""

    def __init__(self, call: Any, delta: bool) -> None:
        self.call = call
        self.delta = delta
        self.lock = asyncio.Lock()
        self.listeners_asked = False  # health goes only after Envoy's first LDS request, as pilot-agent's

    async def write(self, request: Any) -> None:
        async with self.lock:
            await self.call.write(request)


class XdsProxy(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, address: str, credentials: Callable[[], grpc.ChannelCredentials]) -> None:
        """`credentials` is called for every new upstream connection, so it carries the current certificate."""
        self.address = address
        self.credentials = credentials
        self.streams = 0  # upstream streams opened, for logs
        self.health: ProbeResult | None = None  # the readiness probe's last reported state
        self._upstreams: set[_Upstream] = set()
        self._writes: set[asyncio.Task[None]] = set()

    def report_health(self, result: ProbeResult) -> None:
        """The readiness probe changed state: istiod is told on every stream now, and on each new one."""
        self.health = result
        for upstream in self._upstreams:
            if upstream.listeners_asked:
                task = asyncio.create_task(self._send_health(upstream))
                self._writes.add(task)
                task.add_done_callback(self._writes.discard)

    async def _send_health(self, upstream: _Upstream) -> None:
        if self.health is None:
            return
        kind = discovery_pb2.DeltaDiscoveryRequest if upstream.delta else discovery_pb2.DiscoveryRequest
        request = kind(type_url=types.HEALTH_INFO)
        if not self.health.healthy:
            request.error_detail.code = grpc.StatusCode.INTERNAL.value[0]
            request.error_detail.message = self.health.message
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await upstream.write(request)

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        async for response in self._forward(request_iterator, context, "StreamAggregatedResources"):
            yield response

    async def DeltaAggregatedResources(
        self, request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[discovery_pb2.DeltaDiscoveryResponse]:
        async for response in self._forward(request_iterator, context, "DeltaAggregatedResources"):
            yield response

    async def _forward(self, requests: AsyncIterator[Request], context: grpc.aio.ServicerContext,
                       method: str) -> AsyncIterator[Any]:
        self.streams += 1
        stream = self.streams
        try:
            credentials = self.credentials()
        except AgentError as error:
            log.error("xDS proxy: %s", error)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        async with grpc.aio.secure_channel(self.address, credentials, options=UPSTREAM_OPTIONS) as channel:
            call = getattr(ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel), method)()
            stream_to = _Upstream(call, method == "DeltaAggregatedResources")
            self._upstreams.add(stream_to)
            upstream = asyncio.create_task(self._send(requests, stream_to))
            log.info("xDS proxy: stream %d from Envoy, dialling istiod at %s", stream, self.address)
            try:
                async for response in call:
                    XDS_PROXY_RESPONSES.inc()
                    yield response
                log.warning("xDS proxy: istiod at %s ended stream %d", self.address, stream)
            except grpc.aio.AioRpcError as error:
                log.warning("xDS proxy: istiod at %s: stream %d: %s: %s", self.address, stream,
                            error.code().name, error.details())
                await context.abort(error.code(), f"upstream istiod: {error.details()}")
            finally:
                self._upstreams.discard(stream_to)
                upstream.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await upstream


    async def _send(self, requests: AsyncIterator[Request], upstream: _Upstream) -> None:
        """Envoy's requests, upstream. An error here means istiod's side ended: the response loop says why."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            async for request in requests:
                XDS_PROXY_REQUESTS.inc()
                await upstream.write(request)
                if request.type_url == types.LISTENER and not upstream.listeners_asked:
                    upstream.listeners_asked = True
                    await self._send_health(upstream)
            async with upstream.lock:
                await upstream.call.done_writing()

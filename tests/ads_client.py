"""A hand-written ADS client (grpc.aio, in the test process) that ACKs or NACKs what it is told to.

Real grpcio clients only NACK config that is actually broken, and generators must not make broken
config; this client NACKs any type on demand, as a rejecting proxy would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2

TIMEOUT = 5.0
INVALID_ARGUMENT = 3  # the code gRPC's xDS client puts in error_detail


class AdsClient:
    def __init__(self, xds_address: str, node_id: str, namespace: str, istio_version: str = "") -> None:
        metadata = struct_pb2.Struct()
        metadata.update({"GENERATOR": "grpc", "NAMESPACE": namespace, **({"ISTIO_VERSION": istio_version}
                                                                        if istio_version else {})})
        self.node = base_pb2.Node(id=node_id, metadata=metadata)
        self.channel = grpc.aio.insecure_channel(xds_address)
        self._requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()
        self._call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel).StreamAggregatedResources(
            self._request_stream()
        )
        self._sent_node = False
        self.accepted: dict[str, str] = {}  # type URL -> version last ACKed

    async def _request_stream(self) -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    def send(self, type_url: str, names: list[str], response: discovery_pb2.DiscoveryResponse | None = None,
             error: str = "") -> None:
        """A request: new (no response), an ACK of `response`, or a NACK of it when `error` is set."""
        request = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names)
        if not self._sent_node:
            request.node.CopyFrom(self.node)  # only the first request of a stream carries the node
            self._sent_node = True
        if response is not None:
            request.response_nonce = response.nonce
            if error:
                request.version_info = self.accepted.get(type_url, "")  # a NACK names the last good version
                request.error_detail.code = INVALID_ARGUMENT
                request.error_detail.message = error
            else:
                request.version_info = self.accepted[type_url] = response.version_info
        self._requests.put_nowait(request)

    async def receive(self) -> discovery_pb2.DiscoveryResponse:
        response = await asyncio.wait_for(self._call.read(), TIMEOUT)
        assert isinstance(response, discovery_pb2.DiscoveryResponse), f"stream ended: {response!r}"
        return response

    async def subscribe(self, type_url: str, names: list[str], nack: str = "") -> discovery_pb2.DiscoveryResponse:
        """Ask for `names` of one type, then ACK the response, or NACK it with the message `nack`."""
        self.send(type_url, names)
        response = await self.receive()
        assert response.type_url == type_url, response.type_url
        self.send(type_url, names, response, error=nack)
        return response

    async def close(self) -> None:
        self._requests.put_nowait(None)
        self._call.cancel()
        await self.channel.close()

"""A state-of-the-world ADS conversation for the compare tools: send the first requests, ACK each
response with the names the caller still wants, send what the caller asks next, until the server
has been quiet for a while."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

# A response's handler: the resource names to ACK it with, and the requests to send after the ACK.
Answer = Callable[[discovery_pb2.DiscoveryResponse], tuple[list[str], list[discovery_pb2.DiscoveryRequest]]]


async def until_quiet(address: str, first: Iterable[discovery_pb2.DiscoveryRequest], answer: Answer,
                      quiet: float) -> None:
    requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()
    for request in first:
        requests.put_nowait(request)

    async def stream() -> Any:
        while (request := await requests.get()) is not None:
            yield request

    async with grpc.aio.insecure_channel(address) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(stream())
        while True:
            try:
                response = await asyncio.wait_for(call.read(), quiet)
            except asyncio.TimeoutError:
                break
            if response is grpc.aio.EOF:
                break
            names, more = answer(response)
            requests.put_nowait(discovery_pb2.DiscoveryRequest(
                type_url=response.type_url, version_info=response.version_info, response_nonce=response.nonce,
                resource_names=names))
            for request in more:
                requests.put_nowait(request)
        requests.put_nowait(None)
        call.cancel()

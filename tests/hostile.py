"""Hostile load for isolation tests: `python -m tests.hostile stall ADDRESS STREAMS [STREAMS_PER_CONNECTION]`,
and idle HTTP/2-over-TLS connections (`idle_http2`).

Opens ADS streams (every other one delta) that ask for every type, over and over, and never read a
response: each channel
announces a 1 KiB HTTP/2 window and no BDP growth, so istiod's sends to them block at once. Prints
{"streams": N} once every stream has sent its requests, then holds them until killed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import sys

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2

from istiod.xds import types

STREAMS_PER_CHANNEL = 50
NOT_READING = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0), ("grpc.use_local_subchannel_pool", 1)]


# A client's HTTP/2 connection preface and an empty SETTINGS frame: what a gRPC channel sends on connecting.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def idle_http2(port: int) -> ssl.SSLSocket:
    """A TLS connection to 127.0.0.1:`port` that opens HTTP/2, presents no credentials and opens no stream."""
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    tls.set_alpn_protocols(["h2"])
    sock = tls.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5))
    sock.sendall(HTTP2_PREFACE)
    return sock


def closed(sock: ssl.SSLSocket) -> bool:
    """Whether the server closed the connection (what it sent before is read and dropped)."""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass
    except (ssl.SSLWantReadError, BlockingIOError):
        return False
    except OSError:
        return True
    return True


def node(pod: str, namespace: str = "echo-ns") -> base_pb2.Node:
    metadata = struct_pb2.Struct()
    metadata.update({"GENERATOR": "grpc", "NAMESPACE": namespace})
    return base_pb2.Node(id=f"sidecar~127.0.0.1~{pod}.{namespace}~{namespace}.svc.cluster.local", metadata=metadata)


async def stall(address: str, count: int, per_channel: int = STREAMS_PER_CHANNEL) -> None:
    channels = [grpc.aio.insecure_channel(address, options=NOT_READING)
                for _ in range(-(-count // per_channel))]
    stubs = [ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel) for channel in channels]
    delta = [i % 2 == 1 for i in range(count)]
    calls = [stubs[i // per_channel].DeltaAggregatedResources() if delta[i]
             else stubs[i // per_channel].StreamAggregatedResources() for i in range(count)]

    async def ask(i: int) -> None:
        request = discovery_pb2.DeltaDiscoveryRequest if delta[i] else discovery_pb2.DiscoveryRequest
        first = request(type_url=types.CLUSTER, node=node(f"stall-{i}"))
        for message in [first] + [request(type_url=t) for t in types.PUSH_ORDER] * 2:
            await calls[i].write(message)  # waits once istiod stops reading this stream

    writers = [asyncio.create_task(ask(i)) for i in range(count)]
    await asyncio.wait(writers, timeout=10)
    print(json.dumps({"streams": len(calls)}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    command, address, count, *per_channel = sys.argv[1:]
    assert command == "stall", command
    asyncio.run(stall(address, int(count), *map(int, per_channel)))

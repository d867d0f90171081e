"""The TLS front on the secure port: each relayed connection is known to the inner gRPC server by the
certificate its client presented, however many are relayed at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from envoy.service.discovery.v3 import ads_pb2_grpc

from istiod.ca.pki import cert_pem, key_pem, load_certs, new_key, uri_sans
from istiod.ca.signer import issue
from istiod.gen.istio.v1.auth import ca_pb2, ca_pb2_grpc
from tests.pki import csr_pem
from tests.secure_port import TOKEN, Secure, start_secure
from tests.test_ca_service import ads_request

CLIENTS = 24


@pytest.fixture
async def secure(tmp_path: Path) -> AsyncIterator[Secure]:
    port = await start_secure(tmp_path)
    yield port
    await port.port.stop()


async def _renew_as(secure: Secure, identity: str) -> list[str]:
    """A CSR on a connection of its own, proved by a certificate naming `identity`: what it was issued."""
    assert secure.port.ca is not None
    key = new_key()
    leaf = issue(secure.port.ca.bundle, key.public_key(), [x509.UniformResourceIdentifier(identity)],
                 datetime.now(timezone.utc), timedelta(hours=1))
    async with secure.channel(cert=(key_pem(key), cert_pem(leaf).encode())) as channel:
        stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
        response = await stub.CreateCertificate(ca_pb2.IstioCertificateRequest(csr=csr_pem(new_key())), timeout=20)
    return uri_sans(load_certs(response.cert_chain[0].encode(), "leaf")[0])


async def test_connections_relayed_at_once_are_each_known_by_their_own_certificate(secure: Secure) -> None:
    identities = [f"spiffe://cluster.local/ns/app/sa/client{i}" for i in range(CLIENTS)]
    issued = await asyncio.gather(*(_renew_as(secure, identity) for identity in identities))
    assert issued == [[identity] for identity in identities]


def _local_ports_connected_to(port: int) -> set[int]:
    """The local ports of this machine's TCP connections to `port` (the clients' ends; gRPC's sockets are
    IPv6 ones, with IPv4 addresses mapped)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, remote = line.split()[1:3]
            if int(remote.rpartition(":")[2], 16) == port:
                ports.add(int(local.rpartition(":")[2], 16))
    return ports


async def test_an_xds_connection_and_a_csr_are_known_by_the_clients_address(
    secure: Secure, caplog: pytest.LogCaptureFixture,
) -> None:
    """As istiod shows them (its debug connections, its logs): the proxy's address, not the front's."""
    secure_port = int(secure.address.rsplit(":", 1)[1])

    def client_end(peer: str) -> bool:
        host, _, port = peer.removeprefix("ipv4:").rpartition(":")
        return host == "127.0.0.1" and int(port) in _local_ports_connected_to(secure_port)

    async with secure.channel(token=TOKEN) as channel:
        stream = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(timeout=20)
        await stream.write(ads_request("app", "web"))
        await stream.read()
        [connection] = secure.port.ads.connections.values()
        assert client_end(connection.peer), connection.peer
        stream.cancel()
    async with secure.channel(token="not-a-known-token") as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            await ca_pb2_grpc.IstioCertificateServiceStub(channel).CreateCertificate(
                ca_pb2.IstioCertificateRequest(csr=csr_pem(new_key())), timeout=20)
        [refusal] = [r.getMessage() for r in caplog.records if "CA: authentication failed for" in r.getMessage()]
        assert client_end(refusal.split()[4].rstrip(":")), refusal

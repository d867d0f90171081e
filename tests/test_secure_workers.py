"""`--xds-workers 2` with the secure port (15012) served by the workers: real grpcio xDS peers with
their agent's certificate get and ACK their config from a worker process, the agents' first CSRs
(a token, no certificate) and a renewal with a certificate pass through a worker to the CA, a
certificate of another CA is refused, and bad input on the port harms no one."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from istiod.ca.pki import cert_pem, key_pem, load_certs, new_key, uri_sans
from istiod.gen.istio.v1.auth import ca_pb2, ca_pb2_grpc
from tests.conftest import synced
from tests.peers import Istiod, Process, wait_until
from tests.pki import ca_cert, csr_pem, leaf_cert
from tests.test_mtls import CLIENT_ID, Workload, mesh, mtls_call, run_agent

__all__ = ["mesh"]  # the fixture
SERVER_PROXY = "sidecar~127.0.0.71~xecho-1.echo-ns~echo-ns.svc.cluster.local"
CLIENT_PROXY = "sidecar~127.0.0.72~client-1.echo-ns~echo-ns.svc.cluster.local"


def worker_of(istiod: Istiod, proxy: str) -> int | None:
    """The pid of the worker serving `proxy`'s stream, from its connection ID (`<proxy>-w<pid>.<n>`)."""
    status, syncz = istiod.get("/debug/syncz")
    ids = [str(s["connection_id"]) for s in syncz if s["proxy"] == proxy] if status == 200 else []
    return int(ids[0].rsplit("-w", 1)[1].split(".")[0]) if ids else None


def worker_pids(istiod: Istiod) -> set[int]:
    children = Path(f"/proc/{istiod.proc.pid}/task/{istiod.proc.pid}/children").read_text().split()
    return {int(pid) for pid in children if "workers" in Path(f"/proc/{pid}/cmdline").read_text()}


def test_grpc_peers_get_certificates_and_config_through_the_workers(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],
    start_demo: Callable[..., Process], start_agent: Callable[..., Process],
) -> None:
    server, client = mesh["server"], mesh["client"]
    istiod = start_istiod(mesh_dir, "--mtls", "--ca-static-tokens", str(tmp_path / "tokens.json"), "--xds-workers", "2")
    workers = worker_pids(istiod)
    assert len(workers) == 2, istiod.text()
    # The agents' first CSR: a token and no certificate, on 15012, so through a worker to the CA.
    run_agent(start_agent, istiod, server)
    run_agent(start_agent, istiod, client)
    assert uri_sans(load_certs((client.certs / "cert-chain.pem").read_bytes(), "leaf")[0]) == [CLIENT_ID]

    mtls_call(start_demo, istiod, server, client)  # both over 15012 with their agent's certificate
    # The server watches its inbound listener; the client its target's listener, route, cluster, endpoints.
    for proxy, types in ((SERVER_PROXY, ("listener",)), (CLIENT_PROXY, ("listener", "route", "cluster", "endpoint"))):
        wait_until(lambda: synced(istiod, proxy, types), 20, f"{proxy} to ACK {', '.join(types)}")
        served_by = worker_of(istiod, proxy)
        print(f"{proxy} is served by worker {served_by} (istiod {istiod.proc.pid}, workers {sorted(workers)})")
        assert served_by in workers
    assert "CA: issued a certificate for spiffe://cluster.local/ns/echo-ns/sa/client (by StaticTokenAuthenticator)" \
        in istiod.text()


def test_renewal_with_a_certificate_and_refusal_of_another_ca(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],
    start_agent: Callable[..., Process],
) -> None:
    client = mesh["client"]
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(tmp_path / "tokens.json"), "--xds-workers", "2")
    run_agent(start_agent, istiod, client)
    root = istiod.root_cert.read_bytes()
    chain = (client.certs / "cert-chain.pem").read_bytes()
    own = (client.certs / "key.pem").read_bytes()

    async def renew(key: bytes, cert: bytes) -> ca_pb2.IstioCertificateResponse:
        async with grpc.aio.secure_channel(istiod.secure_address, grpc.ssl_channel_credentials(root, key, cert)) as channel:
            stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
            request = ca_pb2.IstioCertificateRequest(csr=csr_pem(new_key(), CLIENT_ID), validity_duration=3600)
            return await stub.CreateCertificate(request, timeout=10)

    # A renewal with the workload's certificate and no token: authenticated by that certificate.
    renewed = asyncio.run(renew(own, chain))
    assert uri_sans(load_certs("".join(renewed.cert_chain).encode(), "leaf")[0]) == [CLIENT_ID]
    assert f"CA: issued a certificate for {CLIENT_ID} (by ClientCertAuthenticator)" in istiod.text()

    # A certificate of another CA, naming the same identity: the TLS handshake is refused.
    other_key = new_key()
    other = ca_cert("other", other_key)
    key = new_key()
    forged = leaf_cert(key, (other, other_key), uris=(CLIENT_ID,))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(renew(key_pem(key), (cert_pem(forged) + cert_pem(other)).encode()))
    print(f"another CA's certificate: {refused.value.code()}: {refused.value.details()}")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_until(lambda: "secure port: TLS handshake refused" in istiod.text(), 5, "istiod's log of the refusal")
    line = next(l for l in istiod.text().splitlines() if "TLS handshake refused" in l)
    print(line)
    assert "client certificate not accepted" in line


def test_bad_input_on_the_port_leaves_the_workers_serving(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],
    start_demo: Callable[..., Process], start_agent: Callable[..., Process],
) -> None:
    server, client = mesh["server"], mesh["client"]
    istiod = start_istiod(mesh_dir, "--mtls", "--ca-static-tokens", str(tmp_path / "tokens.json"), "--xds-workers", "2")
    workers = worker_pids(istiod)
    host, port = istiod.secure_address.rsplit(":", 1)
    sockets = []
    try:
        for _ in range(20):  # idle sockets, and handshakes that never finish: spread over both workers
            idle = socket.create_connection((host, int(port)), timeout=5)
            sockets.append(idle)
            stalled = socket.create_connection((host, int(port)), timeout=5)
            stalled.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # the start of a ClientHello
            sockets.append(stalled)
        for _ in range(10):  # garbage: refused at once
            with socket.create_connection((host, int(port)), timeout=10) as garbage:
                garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 8)
                try:  # closed by istiod at once (after an alert, if any): a timeout here fails the test
                    while garbage.recv(4096):
                        pass
                except ConnectionResetError:
                    pass

        # Meanwhile real peers get certificates and config over the same port.
        started = time.monotonic()
        run_agent(start_agent, istiod, server)
        run_agent(start_agent, istiod, client)
        mtls_call(start_demo, istiod, server, client)
        print(f"certificates and an mTLS call with 40 idle or stalled sockets open: {time.monotonic() - started:.1f}s")
        assert worker_of(istiod, CLIENT_PROXY) in workers
    finally:
        for sock in sockets:
            sock.close()
    assert worker_pids(istiod) == workers  # no worker ended
    assert istiod.proc.poll() is None
    assert "Traceback" not in istiod.text()


"""mTLS end to end: `istiod agent` gets certificates from istiod's CA for a real grpcio xDS client
and a real xDS-enabled grpcio server, which then talk mTLS as istiod's xDS tells them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from istiod.ca.pki import load_certs, uri_sans
from tests.conftest import render
from tests.peers import Istiod, Process, free_port, wait_until

SERVICE_PORT = 7070
TOKENS = {"client-s3cret": "echo-ns/client", "server-s3cret": "echo-ns/xecho"}
CLIENT_ID = "spiffe://cluster.local/ns/echo-ns/sa/client"


@dataclass
class Workload:
    pod: str
    ip: str
    service_account: str
    token: str
    home: Path

    @property
    def certs(self) -> Path:
        return self.home / "certs"

    @property
    def bootstrap(self) -> Path:
        return self.home / "bootstrap.json"

    def serial(self) -> int:
        return load_certs((self.certs / "cert-chain.pem").read_bytes(), "chain")[0].serial_number


@pytest.fixture
def mesh(mesh_dir: Path, tmp_path: Path) -> dict[str, Workload]:
    server = Workload("xecho-1", "127.0.0.71", "xecho", "server-s3cret", tmp_path / "server")
    client = Workload("client-1", "127.0.0.72", "client", "client-s3cret", tmp_path / "client")
    port = free_port(server.ip)
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="xecho", namespace="echo-ns", port=SERVICE_PORT))
    (mesh_dir / "pod.yaml").write_text(render("pod.yaml", pod=server.pod, app="xecho", namespace="echo-ns",
                                              ip=server.ip, port=port))
    (tmp_path / "tokens.json").write_text(json.dumps(TOKENS))
    for workload in (server, client):
        workload.home.mkdir()
        (workload.home / "token").write_text(workload.token)
    server.home.joinpath("port").write_text(str(port))
    return {"server": server, "client": client}


def agent_args(istiod: Istiod, workload: Workload, root: Path | None = None) -> list[str]:
    """`root`: where the agent finds istiod's root (default: the file istiod publishes in config-dir mode)."""
    return ["--ca-addr", istiod.secure_address, "--ca-root-cert", str(root or istiod.root_cert),
            "--token-file", str(workload.home / "token"), "--output-dir", str(workload.certs),
            "--bootstrap", str(workload.bootstrap), "--pod-name", workload.pod, "--pod-namespace", "echo-ns",
            "--instance-ip", workload.ip, "--service-account", workload.service_account, "--cert-refresh-interval", "1s"]


def run_agent(start_agent: Callable[..., Process], istiod: Istiod, workload: Workload, *extra: str,
              root: Path | None = None) -> Process:
    process = start_agent(*agent_args(istiod, workload, root), *extra, name=f"agent-{workload.pod}")
    wait_until(lambda: workload.bootstrap.exists() or process.proc.poll() is not None, 20, f"{workload.pod}'s bootstrap")
    assert workload.bootstrap.exists(), process.log()
    return process


def test_mtls_call_between_agent_certified_peers(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],
    start_demo: Callable[..., Process], start_agent: Callable[..., Process],
) -> None:
    server, client = mesh["server"], mesh["client"]
    istiod = start_istiod(mesh_dir, "--mtls", "--ca-static-tokens", str(tmp_path / "tokens.json"))
    server_agent = run_agent(start_agent, istiod, server, "--cert-ttl", "4s")
    run_agent(start_agent, istiod, client)
    assert uri_sans(load_certs((client.certs / "cert-chain.pem").read_bytes(), "leaf")[0]) == [CLIENT_ID]

    caller, reply = mtls_call(start_demo, istiod, server, client)
    address = f"{server.ip}:{server.home.joinpath('port').read_text()}"

    # A plaintext client straight to the server is refused: the server's listener is STRICT mTLS.
    plain = start_demo("client", address, "--count", "3", "--interval", "0.1", name="plaintext-client")
    lines = [plain.next_json(10) for _ in range(3)]
    print(f"plaintext client: {lines[0]}")
    assert all(not l["ok"] and l["code"] == "UNAVAILABLE" for l in lines), lines

    # The server's 4 s certificate is renewed by its agent at half life; calls go on over mTLS.
    first = server.serial()
    wait_until(lambda: server.serial() != first, 10, "the server's agent to write a renewed certificate")
    wait_until(lambda: "renew_at" in server_agent.text() and server_agent.text().count("wrote certificate") >= 2, 5,
               "the agent's log of the renewal")
    caller.drain()
    assert wait_until(lambda: [l for l in caller.drain() if l["ok"]], 5, "mTLS replies after renewal")[0]["reply"] == reply
    for process in (istiod, server_agent):
        for secret in (*TOKENS, "PRIVATE KEY"):
            assert secret not in process.text()


def mtls_call(start_demo: Callable[..., Process], istiod: Istiod, server: Workload,
              client: Workload, client_id: str = CLIENT_ID) -> tuple[Process, str]:
    """The xDS server and an --mtls xDS client, each with its agent's bootstrap: the client, and the first
    reply, which names the client's SPIFFE identity as the server saw it."""
    address = f"{server.ip}:{server.home.joinpath('port').read_text()}"
    start_demo("server", "--address", address, "--name", server.pod, "--xds", istiod.secure_address,
               "--namespace", "echo-ns", env={"GRPC_XDS_BOOTSTRAP": str(server.bootstrap)}, name="xds-server").next_json(15)
    caller = start_demo("client", f"xds:///xecho.echo-ns.svc.cluster.local:{SERVICE_PORT}", "--mtls",
                        "--xds", istiod.secure_address, "--namespace", "echo-ns", "--count", "0", "--interval", "0.1",
                        env={"GRPC_XDS_BOOTSTRAP": str(client.bootstrap)}, name="mtls-client")
    reply = wait_until(lambda: next((l["reply"] for l in caller.drain() if l["ok"]), None), 20, "an mTLS reply")
    print(f"mTLS reply: {reply}")
    assert reply == f"{server.pod} {address} peer={client_id}"
    return caller, reply


def test_agent_errors_are_clear(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],
    start_agent: Callable[..., Process],
) -> None:
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(tmp_path / "tokens.json"))
    client = mesh["client"]
    (client.home / "token").write_text("n0t-a-t0ken")
    refused = start_agent(*agent_args(istiod, client))
    assert refused.proc.wait(timeout=20) == 1
    assert (f"CA at {istiod.secure_address} refused the certificate request: UNAUTHENTICATED: request authenticate "
            "failure: StaticTokenAuthenticator: the token is not in the static token file") in refused.text()
    assert "n0t-a-t0ken" not in refused.text() + istiod.text()


def test_restart_keeps_the_root(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    first = start_istiod(mesh_dir)
    root = first.root_cert.read_bytes()
    first.stop()
    second = start_istiod(mesh_dir)
    assert second.root_cert.read_bytes() == root
    assert "created a self-signed root CA" in first.text() and "created a self-signed root CA" not in second.text()

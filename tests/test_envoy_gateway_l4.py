"""TCP and TLS servers of an ingress gateway with a real Envoy 1.40 (the set-up of
tests/test_envoy_gateway.py): TLS passed through by SNI to a backend whose own certificate the
client sees (the gateway never opens it), a TCP route, and an HTTPS server with MUTUAL TLS that
refuses a client without a certificate and serves one with a certificate of the `-cacert` CA."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec

from istiod.ca.pki import cert_pem, key_pem
from tests.peers import ROOT, Process, free_port, wait_until
from tests.pki import ca_cert, leaf_cert
from tests.test_envoy_gateway import BIND, NAMESPACE, Gateway, gateway_envoy, mesh  # noqa: F401 (fixture)
from tests.test_gateway_gen import server_credential

BACKEND_IP = "127.0.0.72"
MESH_CLIENT = "spiffe://cluster.local/ns/shop/sa/client"
PASSTHROUGH_HOST = "tls.example.com"


def _objects(backend_port: int, tls_port: int, tcp_port: int, mtls_port: int, istio_port: int, auto_port: int,
             client_ca: bytes) -> list[dict[str, Any]]:
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "tls-app", "namespace": "shop"},
         "spec": {"clusterIP": "10.96.0.11", "selector": {"app": "tls-app"},
                  "ports": [{"name": "tls", "port": 443, "targetPort": backend_port}]}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "tls-app-1", "namespace": "shop", "labels": {"app": "tls-app"}},
         "spec": {"containers": [{"name": "app", "ports": [{"containerPort": backend_port}]}]},
         "status": {"phase": "Running", "podIP": BACKEND_IP, "conditions": [{"type": "Ready", "status": "True"}]}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "web-cert-cacert", "namespace": NAMESPACE},
         "data": {"ca.crt": base64.b64encode(client_ca).decode()}},
        {"apiVersion": "networking.istio.io/v1", "kind": "Gateway", "metadata": {"name": "l4", "namespace": NAMESPACE},
         "spec": {"selector": {"istio": "ingressgateway"}, "servers": [
             {"port": {"number": tls_port, "name": "tls", "protocol": "TLS"}, "bind": BIND,
              "hosts": [f"shop/{PASSTHROUGH_HOST}"], "tls": {"mode": "PASSTHROUGH"}},
             {"port": {"number": tcp_port, "name": "tcp", "protocol": "TCP"}, "bind": BIND, "hosts": ["shop/*"]},
             {"port": {"number": mtls_port, "name": "https-mtls", "protocol": "HTTPS"}, "bind": BIND,
              "hosts": ["shop/secure.example.com"], "tls": {"mode": "MUTUAL", "credentialName": "web-cert"}},
             {"port": {"number": istio_port, "name": "https-mesh", "protocol": "HTTPS"}, "bind": BIND,
              "hosts": ["shop/secure.example.com"],
              "tls": {"mode": "ISTIO_MUTUAL", "subjectAltNames": [MESH_CLIENT]}},
             {"port": {"number": auto_port, "name": "tls-auto", "protocol": "TLS"}, "bind": BIND,
              "hosts": ["*.local"], "tls": {"mode": "AUTO_PASSTHROUGH"}}]}},
        {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": "l4", "namespace": "shop"},
         "spec": {"hosts": [PASSTHROUGH_HOST, "secure.example.com"], "gateways": [f"{NAMESPACE}/l4"],
                  "tls": [{"match": [{"sniHosts": [PASSTHROUGH_HOST]}], "route": [{"destination": {"host": "tls-app"}}]}],
                  "tcp": [{"match": [{"port": tcp_port}], "route": [{"destination": {"host": "web", "port": {"number": 80}}}]}],
                  "http": [{"route": [{"destination": {"host": "web"}}]}]}},
    ]


class L4:
    def __init__(self, gateway: Gateway, workdir: Path, tls_port: int, tcp_port: int, mtls_port: int,
                 istio_port: int, auto_port: int) -> None:
        self.gateway, self.workdir = gateway, workdir
        self.tls_port, self.tcp_port, self.mtls_port, self.istio_port = tls_port, tcp_port, mtls_port, istio_port
        self.auto_port = auto_port


@pytest.fixture
def l4(mesh: Gateway, mesh_dir: Path, processes: list[Process]) -> Iterator[L4]:  # noqa: F811 (the fixture)
    workdir = mesh_dir.parent
    backend_ca, backend_cert, backend_key = server_credential(PASSTHROUGH_HOST)
    (workdir / "backend-ca.pem").write_bytes(backend_ca)
    (workdir / "backend.pem").write_bytes(backend_cert)
    (workdir / "backend-key.pem").write_bytes(backend_key)
    client_ca_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    client_ca = ca_cert("gateway clients", client_ca_key)
    (workdir / "client.pem").write_text(cert_pem(leaf_cert(client_key, (client_ca, client_ca_key), dns=("client",))))
    (workdir / "client-key.pem").write_bytes(key_pem(client_key))
    backend_port = free_port(BACKEND_IP)
    ports = free_port(BIND), free_port(BIND), free_port(BIND), free_port(BIND), free_port(BIND)
    processes.append(Process([sys.executable, str(ROOT / "tests" / "tls_echo.py"), BACKEND_IP, str(backend_port),
                              str(workdir / "backend.pem"), str(workdir / "backend-key.pem"), "tls-app"], name="tls-app"))
    (mesh_dir / "l4.yaml").write_text(yaml.safe_dump_all(_objects(backend_port, *ports, cert_pem(client_ca).encode())))
    with gateway_envoy(mesh) as started:
        yield L4(started, workdir, *ports)


def test_tls_passthrough_and_a_tcp_route(l4: L4) -> None:
    gateway, port = l4.gateway, l4.tls_port
    url = f"https://{PASSTHROUGH_HOST}:{port}/through"
    resolve = ("--resolve", f"{PASSTHROUGH_HOST}:{port}:{BIND}")
    # The backend's own certificate (its CA, not the gateway's): the gateway never opened the TLS.
    status, body = wait_until(lambda: (r := gateway.curl(url, *resolve, "--cacert", str(l4.workdir / "backend-ca.pem")))[0] == 200
                              and r, 15, "TLS passed through to the backend")
    print("TLS passthrough:", status, body)
    assert json.loads(body) == {"name": "tls-app", "path": "/through"}
    assert gateway.curl(url, *resolve, "--cacert", str(l4.workdir / "ca.pem"))[0] == 0  # not the gateway's certificate
    other = "other.example.com"  # an SNI no tls route names: no filter chain, the connection is closed
    assert gateway.curl(f"https://{other}:{port}/", "--resolve", f"{other}:{port}:{BIND}", "-k")[0] == 0
    status, body = gateway.curl(f"http://{BIND}:{l4.tcp_port}/over-tcp")
    print("TCP route:", status, body)
    assert status == 200 and json.loads(body)["path"] == "/over-tcp"


def test_mutual_tls_refuses_a_client_without_a_certificate(l4: L4) -> None:
    gateway, port, host = l4.gateway, l4.mtls_port, "secure.example.com"
    args = (f"https://{host}:{port}/mtls", "--resolve", f"{host}:{port}:{BIND}", "--cacert", str(l4.workdir / "ca.pem"))
    client = ("--cert", str(l4.workdir / "client.pem"), "--key", str(l4.workdir / "client-key.pem"))
    status, body = wait_until(lambda: (r := gateway.curl(*args, *client))[0] == 200 and r, 15, "MUTUAL with a client certificate")
    print("MUTUAL with a client certificate:", status, body)
    assert json.loads(body)["host"] == f"{host}:{port}"
    status, body = gateway.curl(*args)
    print("MUTUAL without a client certificate:", status, body.strip()[:120])
    assert status == 0
    # A certificate of a CA the -cacert Secret does not hold is refused too.
    other_ca, other_cert, other_key = server_credential("client")
    (l4.workdir / "other.pem").write_bytes(other_cert)
    (l4.workdir / "other-key.pem").write_bytes(other_key)
    assert gateway.curl(*args, "--cert", str(l4.workdir / "other.pem"), "--key", str(l4.workdir / "other-key.pem"))[0] == 0


def test_istio_mutual_takes_a_client_of_the_mesh_only(l4: L4) -> None:
    """ISTIO_MUTUAL: the gateway's own mesh certificate (from its agent's SDS), and a client
    certificate the mesh root signed for an identity of subjectAltNames."""
    gateway, port, host = l4.gateway, l4.istio_port, "secure.example.com"
    assert gateway.sds is not None
    signer = (gateway.sds.root, gateway.sds.root_key)
    for name, identity in (("mesh", MESH_CLIENT), ("stranger", "spiffe://cluster.local/ns/shop/sa/other")):
        key = ec.generate_private_key(ec.SECP256R1())
        (l4.workdir / f"{name}.pem").write_text(cert_pem(leaf_cert(key, signer, uris=(identity,))))
        (l4.workdir / f"{name}-key.pem").write_bytes(key_pem(key))
    # -k: the gateway presents its workload certificate (a SPIFFE ID, no DNS name), as istiod's would.
    args = (f"https://{host}:{port}/mesh", "--resolve", f"{host}:{port}:{BIND}", "-k")

    def client(name: str) -> tuple[str, ...]:
        return "--cert", str(l4.workdir / f"{name}.pem"), "--key", str(l4.workdir / f"{name}-key.pem")

    status, body = wait_until(lambda: (r := gateway.curl(*args, *client("mesh")))[0] == 200 and r, 15,
                              "ISTIO_MUTUAL with a mesh client certificate")
    print("ISTIO_MUTUAL with a mesh client:", status, body[:80])
    assert gateway.curl(*args)[0] == 0  # no client certificate
    assert gateway.curl(*args, *client("stranger"))[0] == 0  # an identity subjectAltNames does not name
    assert gateway.curl(*args, "--cert", str(l4.workdir / "client.pem"), "--key", str(l4.workdir / "client-key.pem"))[0] == 0


def _through_auto_passthrough(l4: L4, sni: str, alpn: list[str]) -> str:
    """A GET over TLS with SNI `sni` and ALPN `alpn` to the AUTO_PASSTHROUGH port, verifying the
    backend's own certificate (its CA); the response, or the error."""
    context = ssl.create_default_context(cafile=str(l4.workdir / "backend-ca.pem"))
    context.check_hostname = False  # the SNI names the cluster, the certificate the backend's host
    context.set_alpn_protocols(alpn)
    try:
        with socket.create_connection((BIND, l4.auto_port), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname=sni) as tls:
            tls.sendall(b"GET /auto HTTP/1.0\r\nHost: x\r\n\r\n")
            return b"".join(iter(lambda: tls.recv(4096), b"")).decode()
    except (OSError, ssl.SSLError) as error:
        return f"error: {error}"


def test_auto_passthrough_by_the_sni_of_a_mesh_service(l4: L4) -> None:
    """AUTO_PASSTHROUGH (an east-west gateway's): the SNI `outbound_.<port>_._.<host>` picks the
    service's endpoints; the TLS is the backend's, and only a client speaking Istio's ALPN is taken."""
    sni = "outbound_.443_._.tls-app.shop.svc.cluster.local"
    reply = wait_until(lambda: (r := _through_auto_passthrough(l4, sni, ["istio"])).startswith("HTTP/1.0 200") and r,
                       15, "the service's backend by its SNI")
    print("AUTO_PASSTHROUGH:", reply.splitlines()[0], reply.splitlines()[-1])
    assert json.loads(reply.split("\r\n\r\n", 1)[1]) == {"name": "tls-app", "path": "/auto"}
    assert _through_auto_passthrough(l4, sni, ["h2"]).startswith("error")  # not Istio's mTLS ALPN
    assert _through_auto_passthrough(l4, "outbound_.443_._.nowhere.shop.svc.cluster.local", ["istio"]).startswith("error")

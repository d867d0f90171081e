"""An ingress gateway: a real Envoy 1.40 started as `router`, on istiod's TLS xDS port with a client
certificate from istiod's CA (a gateway's credentials go only to a verified proxy), its listeners
bound on a loopback address. HTTPS (SIMPLE, the certificate of a Secret over SDS) and HTTP requests
made with curl reach a mesh service (tests/http_echo.py) through it; a changed Secret is served
without restarting Envoy."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec

from istiod.ca.pki import cert_pem, key_pem, load_certs, load_key
from tests.conftest import render, synced
from tests.envoy_peer import HTTP2, Envoy, SdsServer, bootstrap
from tests.peers import ROOT, Istiod, Process, free_port, wait_until
from tests.pki import leaf_cert
from tests.test_envoy_authn import ISSUER, Signer
from tests.test_gateway_gen import server_credential, tls_secret

BIND, APP_IP = "127.0.0.70", "127.0.0.71"
NAMESPACE, SERVICE_ACCOUNT = "istio-ingress", "ingress"
TOKEN = "ingress-s3cret"
NODE = f"router~{BIND}~ingress-1.{NAMESPACE}~{NAMESPACE}.svc.cluster.local"


def _write_secret(mesh_dir: Path, cert: bytes, key: bytes) -> None:
    (mesh_dir / "secret.yaml").write_text(yaml.safe_dump(tls_secret("web-cert", NAMESPACE, cert, key)))


def _client_certificate(istiod: Istiod, workdir: Path) -> tuple[Path, Path]:
    """The gateway's workload certificate, signed by istiod's own CA (what its agent would get)."""
    ca_dir = istiod.state_dir / "istio-ca-secret"
    ca = load_certs((ca_dir / "ca-cert.pem").read_bytes(), "ca-cert.pem")[0]
    ca_key = load_key((ca_dir / "ca-key.pem").read_bytes(), "ca-key.pem")
    key = ec.generate_private_key(ec.SECP256R1())
    identity = f"spiffe://cluster.local/ns/{NAMESPACE}/sa/{SERVICE_ACCOUNT}"
    (workdir / "cert.pem").write_text(cert_pem(leaf_cert(key, (ca, ca_key), uris=(identity,))))
    (workdir / "key.pem").write_bytes(key_pem(key))
    return workdir / "cert.pem", workdir / "key.pem"


def gateway_bootstrap(istiod: Istiod, workdir: Path, delta: bool = False) -> dict[str, Any]:
    """ADS over TLS to istiod's secure port, as the agent's xDS proxy connects; `sds-grpc` (the
    workload certificate for mTLS to the mesh) on a Unix socket. The Gateway's credentials come over ADS."""
    cert, key = _client_certificate(istiod, workdir)
    host, port = istiod.secure_address.rsplit(":", 1)
    tls = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {
                "alpn_protocols": ["h2"],
                "tls_certificates": [{"certificate_chain": {"filename": str(cert)}, "private_key": {"filename": str(key)}}],
                "validation_context": {"trusted_ca": {"filename": str(istiod.root_cert)}},
            },
        },
    }
    xds = {"name": "xds-grpc", "type": "STATIC", "connect_timeout": "1s", "typed_extension_protocol_options": HTTP2,
           "transport_socket": tls,
           "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [
               {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}]}]}}
    config = bootstrap(NODE, workdir / "unused", workdir / "sds", workdir / "admin", {
        "SERVICE_ACCOUNT": SERVICE_ACCOUNT, "LABELS": {"istio": "ingressgateway", "app": "istio-ingressgateway"}}, delta)
    config["static_resources"]["clusters"][0] = xds
    return config


class Gateway:
    """The mesh behind the gateway, istiod, and (once started) the gateway's Envoy."""

    def __init__(self, mesh_dir: Path, istiod: Istiod, http_port: int, https_port: int) -> None:
        self.mesh_dir, self.istiod = mesh_dir, istiod
        self.http_port, self.https_port = http_port, https_port
        self.envoy: Envoy | None = None
        self.sds: SdsServer | None = None  # the mesh certificate the gateway's Envoy is served

    def curl(self, url: str, *options: str) -> tuple[int, str]:
        """(HTTP status, body) of curl's request; status 0 when the connection or handshake failed."""
        result = subprocess.run(["curl", "-sS", "--max-time", "5", "-w", "\n%{http_code}", *options, url],
                                capture_output=True, text=True, timeout=10)
        body, _, status = result.stdout.rpartition("\n")
        return int(status or 0), body or result.stderr

    def https(self, path: str, ca: Path) -> tuple[int, str]:
        host = "secure.example.com"
        return self.curl(f"https://{host}:{self.https_port}{path}",
                         "--resolve", f"{host}:{self.https_port}:{BIND}", "--cacert", str(ca))

    def http(self, path: str) -> tuple[int, str]:
        host = "web.example.com"
        return self.curl(f"http://{host}:{self.http_port}{path}", "--resolve", f"{host}:{self.http_port}:{BIND}")


@pytest.fixture
def mesh(mesh_dir: Path, start_istiod: Callable[..., Istiod], processes: list[Process]) -> Gateway:
    app_port, http_port, https_port = free_port(APP_IP), free_port(BIND), free_port(BIND)
    (mesh_dir / "mesh.yaml").write_text(render("gateway-mesh.yaml", app_ip=APP_IP, app_port=app_port, bind=BIND,
                                               http_port=http_port, https_port=https_port))
    ca, cert, key = server_credential("secure.example.com")
    _write_secret(mesh_dir, cert, key)
    (mesh_dir.parent / "ca.pem").write_bytes(ca)
    (mesh_dir.parent / "tokens.json").write_text(json.dumps({TOKEN: f"{NAMESPACE}/{SERVICE_ACCOUNT}"}))
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh_dir.parent / "tokens.json"))
    processes.append(Process([sys.executable, str(ROOT / "tests" / "http_echo.py"), APP_IP, str(app_port)], name="echo"))
    return Gateway(mesh_dir, istiod, http_port, https_port)


@contextmanager
def gateway_envoy(mesh: Gateway, delta: bool = False) -> Iterator[Gateway]:
    """The gateway's Envoy started by the test, with its own bootstrap; `delta`: incremental xDS."""
    workdir = Path(tempfile.mkdtemp(prefix="envoy-gw-", dir="/tmp"))  # Unix socket paths must stay short
    sds = None
    istiod = mesh.istiod
    try:
        sds = mesh.sds = SdsServer(workdir / "sds", f"spiffe://cluster.local/ns/{NAMESPACE}/sa/{SERVICE_ACCOUNT}")
        envoy = mesh.envoy = Envoy(gateway_bootstrap(istiod, workdir, delta), workdir, name="envoy-gateway",
                                   netns=False)
        try:
            wait_until(lambda: synced(istiod, NODE, ("cluster", "listener", "endpoint", "route"))
                       and envoy.get("/ready")[0] == 200, 20, "the gateway synced and its listeners warm")
        except AssertionError:
            raise AssertionError(f"syncz: {istiod.get('/debug/syncz')[1]}\nEnvoy:\n{envoy.log()[-6000:]}") from None
        yield mesh
    finally:
        for stoppable in (mesh.envoy, sds):
            if stoppable is not None:
                stoppable.stop()
        mesh.envoy = mesh.sds = None
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def gateway(mesh: Gateway) -> Iterator[Gateway]:
    with gateway_envoy(mesh) as started:
        yield started


def test_https_and_http_through_the_gateway_reach_the_service(gateway: Gateway, mesh_dir: Path) -> None:
    status, body = gateway.https("/hello", mesh_dir.parent / "ca.pem")
    assert status == 200, body
    print("HTTPS through the gateway:", status, body)
    assert json.loads(body)["host"] == f"secure.example.com:{gateway.https_port}"
    status, body = gateway.http("/hello")
    print("HTTP through the gateway:", status, body)
    assert status == 200 and json.loads(body)["host"] == f"web.example.com:{gateway.http_port}"
    assert gateway.http("/teapot")[0] == 418  # the VirtualService's fault, on this gateway's route
    assert gateway.http("/mesh-only")[0] == 200  # a match for `mesh` only is not the gateway's
    # A host no VirtualService binds to the gateway: Envoy's 404.
    host = "elsewhere.example.com"
    assert gateway.curl(f"http://{host}:{gateway.http_port}/", "--resolve", f"{host}:{gateway.http_port}:{BIND}")[0] == 404


def test_https_redirect_answers_301(gateway: Gateway) -> None:
    port = free_port(BIND)
    redirect = {"apiVersion": "networking.istio.io/v1", "kind": "Gateway",
                "metadata": {"name": "redirect", "namespace": NAMESPACE},
                "spec": {"selector": {"istio": "ingressgateway"}, "servers": [
                    {"port": {"number": port, "name": "http", "protocol": "HTTP"}, "bind": BIND,
                     "hosts": ["shop/web.example.com"], "tls": {"httpsRedirect": True}}]}}
    bound = {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
             "metadata": {"name": "redirected", "namespace": "shop"},
             "spec": {"hosts": ["web.example.com"], "gateways": [f"{NAMESPACE}/redirect"],
                      "http": [{"route": [{"destination": {"host": "web"}}]}]}}
    (gateway.mesh_dir / "redirect.yaml").write_text(yaml.safe_dump_all([redirect, bound]))
    url = f"http://web.example.com:{port}/page"
    resolve = ("--resolve", f"web.example.com:{port}:{BIND}", "-D", "-")
    status, headers = wait_until(lambda: (reply := gateway.curl(url, *resolve))[0] == 301 and reply, 10,
                                 "the redirecting server")
    print("HTTP on the httpsRedirect server:", status, headers.splitlines()[:2])
    assert f"location: https://web.example.com:{port}/page" in headers.lower()


def test_a_changed_secret_is_served_without_restarting_envoy(gateway: Gateway, mesh_dir: Path) -> None:
    assert gateway.https("/", mesh_dir.parent / "ca.pem")[0] == 200
    assert gateway.envoy is not None
    pid = gateway.envoy.process.proc.pid
    ca, cert, key = server_credential("secure.example.com")
    (mesh_dir.parent / "new-ca.pem").write_bytes(ca)
    _write_secret(mesh_dir, cert, key)
    wait_until(lambda: gateway.https("/", mesh_dir.parent / "new-ca.pem")[0] == 200, 10, "the new certificate served")
    status, body = gateway.https("/", mesh_dir.parent / "ca.pem")
    print("the old CA after the rotation:", status, body)
    assert status == 0  # the old certificate is gone
    assert gateway.envoy.process.proc.pid == pid and gateway.envoy.process.proc.poll() is None


def test_a_gateway_on_incremental_xds(mesh: Gateway) -> None:
    """The credential over delta ADS too: a rotation reaches the Envoy as an updated resource."""
    with gateway_envoy(mesh, delta=True):
        status, body = mesh.https("/delta", mesh.mesh_dir.parent / "ca.pem")
        print("HTTPS through the delta gateway:", status, body)
        assert status == 200
        ca, cert, key = server_credential("secure.example.com")
        (mesh.mesh_dir.parent / "new-ca.pem").write_bytes(ca)
        _write_secret(mesh.mesh_dir, cert, key)
        wait_until(lambda: mesh.https("/", mesh.mesh_dir.parent / "new-ca.pem")[0] == 200, 10, "the new certificate")


def test_secrets_stay_out_of_logs_and_debug_output(gateway: Gateway, mesh_dir: Path) -> None:
    key = base64.b64decode(yaml.safe_load((mesh_dir / "secret.yaml").read_text())["data"]["tls.key"]).decode()
    body = key.splitlines()[1]  # a line of the key's base64 body
    for path in ("/debug/configz", f"/debug/config_dump?proxyID={NODE}", "/debug/adsz", "/debug/syncz",
                 "/debug/push_status"):
        status, reply = gateway.istiod.get(path)
        assert status == 200, (path, reply)
        assert body not in json.dumps(reply), path
    assert body not in gateway.istiod.text()
    assert "kubernetes://web-cert" in json.dumps(gateway.istiod.get("/debug/adsz")[1])  # asked for over ADS


@contextmanager
def agent_gateway(mesh: Gateway, processes: list[Process], labels: dict[str, str]) -> Iterator[Process]:
    """`istiod agent proxy router` with the pod's `labels`, ready; stopped and cleaned up after."""
    workdir = Path(tempfile.mkdtemp(prefix="agent-gw-", dir="/tmp"))
    try:
        (workdir / "token").write_text(TOKEN)
        readiness = free_port()
        agent = Process([
            sys.executable, "-m", "istiod", "agent",
            "--ca-addr", mesh.istiod.secure_address, "--ca-root-cert", str(mesh.istiod.root_cert),
            "--token-file", str(workdir / "token"), "--output-dir", str(workdir / "certs"),
            "--pod-name", "ingress-1", "--pod-namespace", NAMESPACE, "--instance-ip", BIND,
            "--service-account", SERVICE_ACCOUNT,
            "proxy", "router", "--workdir", str(workdir), "--proxy-admin-addr", "unix:admin.sock",
            "--status-addr", f"127.0.0.1:{free_port()}", "--readiness-addr", f"127.0.0.1:{readiness}",
            "--envoy-prometheus-addr", f"127.0.0.1:{free_port()}", "--termination-drain-duration", "1s",
        ], env={"ISTIO_METAJSON_LABELS": json.dumps(labels)}, name="agent-gateway")
        processes.append(agent)
        ready = f"http://127.0.0.1:{readiness}/healthz/ready"
        try:
            wait_until(lambda: subprocess.run(["curl", "-sf", "--max-time", "2", ready]).returncode == 0, 30,
                       "the agent's gateway ready")
        except AssertionError:
            raise AssertionError(f"agent:\n{agent.log()[-6000:]}") from None
        yield agent
        agent.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_agent_runs_a_gateway(mesh: Gateway, processes: list[Process]) -> None:
    """`istiod agent proxy router`: the agent's Envoy gets its config through the agent's xDS proxy
    (on istiod's TLS port, with the certificate the agent got for the gateway), so it is sent the
    Gateway's credential."""
    with agent_gateway(mesh, processes, {"istio": "ingressgateway"}):
        status, body = mesh.https("/via-agent", mesh.mesh_dir.parent / "ca.pem")
        print("HTTPS through the agent's gateway:", status, body)
        assert status == 200 and json.loads(body)["host"] == f"secure.example.com:{mesh.https_port}"
        assert mesh.http("/via-agent")[0] == 200


def test_routing_by_a_jwt_claim_at_the_gateway(gateway: Gateway) -> None:
    """A RequestAuthentication on the gateway verifies the token; a VirtualService header match on
    `@request.auth.claims.groups` routes by its claim (a string or one of a list), as istiod routes."""
    signer = Signer()
    port = free_port(BIND)
    objects = [
        {"apiVersion": "security.istio.io/v1", "kind": "RequestAuthentication",
         "metadata": {"name": "gateway", "namespace": NAMESPACE},
         "spec": {"selector": {"matchLabels": {"istio": "ingressgateway"}},
                  "jwtRules": [{"issuer": ISSUER, "jwks": signer.jwks()}]}},
        {"apiVersion": "networking.istio.io/v1", "kind": "Gateway", "metadata": {"name": "claims", "namespace": NAMESPACE},
         "spec": {"selector": {"istio": "ingressgateway"}, "servers": [
             {"port": {"number": port, "name": "http", "protocol": "HTTP"}, "bind": BIND,
              "hosts": ["shop/claims.example.com"]}]}},
        {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": "claims", "namespace": "shop"},
         "spec": {"hosts": ["claims.example.com"], "gateways": [f"{NAMESPACE}/claims"], "http": [
             {"name": "admins", "match": [{"headers": {"@request.auth.claims.groups": {"exact": "admins"}}}],
              "directResponse": {"status": 200, "body": {"string": "admins"}}},
             {"name": "others", "route": [{"destination": {"host": "web"}}]}]}},
    ]
    (gateway.mesh_dir / "claims.yaml").write_text(yaml.safe_dump_all(objects))
    url = f"http://claims.example.com:{port}/"
    resolve = ("--resolve", f"claims.example.com:{port}:{BIND}")

    def call(token: str | None) -> tuple[int, str]:
        return gateway.curl(url, *resolve, *(["-H", f"Authorization: Bearer {token}"] if token else []))

    admin = signer.token(groups=["users", "admins"])
    wait_until(lambda: call(admin) == (200, "admins"), 15, "the claim's route on the gateway")
    assert call(signer.token(groups="admins")) == (200, "admins")  # a string claim
    for token in (signer.token(groups=["users"]), None):
        status, body = call(token)
        assert status == 200 and json.loads(body)["host"].startswith("claims.example.com"), (status, body)
    assert call(Signer().token(groups=["admins"]))[0] == 401  # signed by a key the JWKS lacks

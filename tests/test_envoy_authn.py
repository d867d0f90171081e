"""AuthorizationPolicy on a real Envoy sidecar's TCP ports (the RBAC network filter) and
RequestAuthentication (jwt_authn with an inline JWKS) before RBAC on its HTTP ports: clients in the
sidecar's network namespace, through the capture rules, as in test_envoy_inbound_policy."""

from __future__ import annotations

import base64
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from tests.envoy_peer import Envoy, sidecar_envoy
from tests.peers import Istiod, Process, wait_until
from tests.test_envoy_sidecar import _mesh, captured_pod

# web-1 (127.0.0.31) also serves a TCP port, 9000, for the Service echo.
ECHO_SERVICE = """apiVersion: v1
kind: Service
metadata: {name: echo, namespace: shop}
spec:
  clusterIP: 10.96.0.13
  selector: {app: web}
  ports: [{name: tcp-echo, port: 9000}]
"""
POLICY = """apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: web, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
"""
TCP_ECHO = """
import socketserver, sys
class Echo(socketserver.StreamRequestHandler):
    def handle(self):
        self.wfile.write(self.rfile.readline())
socketserver.TCPServer((sys.argv[1], int(sys.argv[2])), Echo).serve_forever()
"""
TCP_CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as s:
        s.sendall(b"ping\\n")
        print(repr(s.recv(100)))
except OSError as e:
    print(type(e).__name__)
"""


def _skip_without_iptables() -> None:
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (Debian's package) for the capture rules")


@contextmanager
def _pod(istiod: Istiod, *apps: tuple[str, ...]) -> Iterator[tuple[Envoy, Callable[..., Any]]]:
    """web-1 with its sidecar, capture rules and HTTP app, plus `apps` (Python code and arguments)
    run in its network namespace; yields the sidecar and `run`, a command in that namespace."""
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as envoy, \
            captured_pod(istiod, envoy) as run:
        started = []
        try:
            for code, *args in apps:
                started.append(Process(envoy.netns(sys.executable, "-c", code, *args), name="app"))
            yield envoy, run
        finally:
            for app in started:
                app.stop()


def test_tcp_port_authorization(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    """A DENY on the TCP port closes connections (its HTTP-only `methods` ignored there, denying
    more); an ALLOW for web's identity lets web's mTLS connection through, and its HTTP-only rule
    (GET) opens the HTTP port to plaintext but not the TCP port (left out there, allowing less)."""
    _skip_without_iptables()
    _mesh(mesh_dir)
    (mesh_dir / "echo.yaml").write_text(ECHO_SERVICE)
    istiod = start_istiod(mesh_dir)
    with _pod(istiod, (TCP_ECHO, "127.0.0.31", "9000")) as (envoy, run):
        # echo's VIP routable in the pod (the capture takes it from there), and inbound 9000 captured.
        for command in (("ip", "addr", "add", "10.96.0.13/32", "dev", "lo"),
                        ("iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", "127.0.0.31", "--dport", "9000",
                         "-j", "REDIRECT", "--to-ports", "15006")):
            assert run(*command).returncode == 0, command

        def tcp(host: str) -> str:
            line = run(sys.executable, "-c", TCP_CLIENT, host, "9000").stdout.strip()
            print(f"tcp {host}:9000: {line}")
            return line

        def http(url: str) -> str:
            done = run("curl", "-s", "--max-time", "5", "-o", "/dev/null", "-w", "%{http_code}", url)
            print(f"curl {url}: {done.stdout}")
            return done.stdout

        # No policy: the echo answers through the sidecars (mTLS by the VIP) and in plaintext.
        wait_until(lambda: tcp("10.96.0.13") == "b'ping\\n'", 10, "the echo through the sidecar")
        assert tcp("127.0.0.31") == "b'ping\\n'"

        (mesh_dir / "ap.yaml").write_text(POLICY + """  action: DENY
  rules: [{to: [{operation: {ports: ["9000"], methods: [GET]}}]}]
""")
        wait_until(lambda: tcp("10.96.0.13") == "b''", 10, "the TCP connection closed by the DENY")
        assert tcp("127.0.0.31") in ("b''", "ConnectionResetError")
        assert wait_until(lambda: http("http://10.96.0.10/") == "200", 10, "HTTP on 8080 still served")

        (mesh_dir / "ap.yaml").write_text(POLICY + """  rules:
  - from: [{source: {principals: [cluster.local/ns/shop/sa/web]}}]
  - to: [{operation: {methods: [GET]}}]
""")
        wait_until(lambda: tcp("10.96.0.13") == "b'ping\\n'", 10, "web's identity allowed over mTLS")
        assert tcp("127.0.0.31") in ("b''", "ConnectionResetError")  # plaintext: no identity
        assert http("http://127.0.0.31:8080/") == "200"  # the GET rule applies on HTTP ports
        stats = envoy.get("/stats?filter=rbac")[1]
        print(f"Envoy's stats:\n{stats}")
        assert "tcp.rbac.denied: 0" not in stats and "tcp.rbac.allowed: 0" not in stats


ISSUER = "https://issuer.test"


class Signer:
    """An RS256 key, its JWKS and the tokens it signs."""

    def __init__(self, kid: str = "test-key") -> None:
        self.kid = kid
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def jwks(self) -> str:
        numbers = self.key.public_key().public_numbers()
        return json.dumps({"keys": [{"kty": "RSA", "alg": "RS256", "use": "sig", "kid": self.kid,
                                     "n": _b64(numbers.n.to_bytes((numbers.n.bit_length() + 7) // 8, "big")),
                                     "e": _b64(numbers.e.to_bytes(3, "big"))}]})

    def token(self, **claims: Any) -> str:
        now = int(time.time())
        payload = {"iss": ISSUER, "sub": "alice", "aud": "web", "iat": now, "exp": now + 600, **claims}
        header = {"alg": "RS256", "typ": "JWT", "kid": self.kid}
        signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(payload).encode())}"
        signature = self.key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64(signature)}"


def _other_kinds_of_keys() -> str:
    point = ec.generate_private_key(ec.SECP256R1()).public_key().public_numbers()
    edwards = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    return json.dumps({"keys": [
        {"kty": "EC", "crv": "P-256", "x": _b64(point.x.to_bytes(32)), "y": _b64(point.y.to_bytes(32))},
        {"kty": "OKP", "crv": "Ed25519", "x": _b64(edwards)},
        {"kty": "oct", "k": _b64(b"a shared secret")},
    ]})


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_jwt_accepted_and_refused(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    """RequestAuthentication with an inline JWKS: a valid token passes; a bad signature, an expired
    token, another issuer or audience is a 401 from jwt_authn; no token passes authentication and
    is then refused (403) by an AuthorizationPolicy that wants a request principal and a claim."""
    _skip_without_iptables()
    _mesh(mesh_dir)
    signer, stranger = Signer(), Signer()
    (mesh_dir / "ra.yaml").write_text(f"""apiVersion: security.istio.io/v1
kind: RequestAuthentication
metadata: {{name: web, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: web}}}}
  jwtRules:
  - issuer: {ISSUER}
    audiences: [web]
    jwks: '{signer.jwks()}'
  - issuer: https://other-kinds.test  # a second provider: every other kind of key validation accepts
    jwks: '{_other_kinds_of_keys()}'
""")
    (mesh_dir / "ap.yaml").write_text(POLICY + f"""  rules:
  - from: [{{source: {{requestPrincipals: ["{ISSUER}/*"]}}}}]
    when: [{{key: "request.auth.claims[groups]", values: [admins]}}]
""")
    istiod = start_istiod(mesh_dir)
    with _pod(istiod) as (envoy, run):
        def call(token: str | None) -> str:
            """`<status> <body>` of a plaintext GET to the app's port, through the sidecar."""
            auth = ["-H", f"Authorization: Bearer {token}"] if token is not None else []
            done = run("curl", "-s", "--max-time", "5", "-w", " %{http_code}", *auth, "http://127.0.0.31:8080/")
            body, _, status = done.stdout.rpartition(" ")
            return f"{status} {body[:60]}"

        admin = signer.token(groups=["admins"])
        wait_until(lambda: call(admin).startswith("200"), 10, "a valid token accepted")
        tampered = admin[:-4] + ("AAAA" if not admin.endswith("AAAA") else "BBBB")
        cases = {
            "valid, in group admins": (admin, "200"),
            "valid, not in group admins": (signer.token(groups=["users"]), "403 RBAC: access denied"),
            "no token": (None, "403 RBAC: access denied"),
            "bad signature": (tampered, "401 Jwt verification fails"),
            "signed by another key": (stranger.token(groups=["admins"]), "401 Jwt verification fails"),
            "expired": (signer.token(groups=["admins"], exp=int(time.time()) - 3600), "401 Jwt is expired"),
            "another issuer": (signer.token(groups=["admins"], iss="https://other.test"),
                               "401 Jwt issuer is not configured"),
            # Envoy (and so Istio) answers a wrong audience 403, not 401.
            "another audience": (signer.token(groups=["admins"], aud="db"), "403 Audiences in Jwt are not allowed"),
        }
        for name, (token, expected) in cases.items():
            seen = call(token)
            print(f"{name}: {seen}")
            assert seen.startswith(expected), (name, seen)
        stats = envoy.get("/stats?filter=jwt_authn|8080.rbac")[1]
        print(f"Envoy's stats:\n{stats}")

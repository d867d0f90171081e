"""RequestAuthentication with a jwksUri on a real Envoy sidecar: istiod fetches the keys from an
HTTPS server on 127.0.0.1 (trusted through SSL_CERT_FILE), serves them inline, and serves rotated
keys after its refresh; an unreachable URI serves keys no token verifies against, said in one log
line and pilot_jwks_resolver_network_fetch_fail_total."""

from __future__ import annotations

import http.server
import json
import re
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from istiod.ca.pki import cert_pem, key_pem, new_key
from tests.peers import Istiod, wait_until
from tests.pki import ca_cert, leaf_cert
from tests.test_envoy_authn import ISSUER, Signer, _pod, _skip_without_iptables
from tests.test_envoy_sidecar import _mesh


@contextmanager
def jwks_server(tmp_path: Path, keys: dict[str, str]) -> Iterator[tuple[int, Path]]:
    """An HTTPS server on 127.0.0.1 answering GET /jwks with keys["jwks"], and its OpenID discovery
    document naming /jwks; yields its port and the root that signed its certificate."""
    root_key, leaf_key = new_key(), new_key()
    root = ca_cert("jwks test root", root_key)
    (tmp_path / "jwks-root.pem").write_text(cert_pem(root))
    (tmp_path / "jwks.pem").write_text(cert_pem(leaf_cert(leaf_key, (root, root_key), ips=("127.0.0.1",))))
    (tmp_path / "jwks-key.pem").write_bytes(key_pem(leaf_key))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            issuer = f"https://127.0.0.1:{server.server_address[1]}"
            documents = {"/jwks": keys["jwks"], "/.well-known/openid-configuration": json.dumps(
                {"issuer": issuer, "jwks_uri": f"{issuer}/jwks"})}
            body = documents.get(self.path, "not found").encode()
            self.send_response(200 if self.path in documents else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "jwks.pem", tmp_path / "jwks-key.pem")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], tmp_path / "jwks-root.pem"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def request_authentication(*rules: tuple[str, str]) -> str:
    """JWT rules (issuer, jwksUri); no jwksUri: the issuer's OpenID discovery document names it."""
    jwt_rules = ""
    for issuer, uri in rules:
        source = f'jwksUri: "{uri}", ' if uri else ""
        jwt_rules += f'  - {{issuer: "{issuer}", {source}timeout: 2s}}\n'
    return ("apiVersion: security.istio.io/v1\nkind: RequestAuthentication\nmetadata: {name: web, namespace: shop}\n"
            f"spec:\n  selector: {{matchLabels: {{app: web}}}}\n  jwtRules:\n{jwt_rules}")


def test_jwks_uri_fetched_rotated_and_unreachable(tmp_path: Path, mesh_dir: Path,
                                                   start_istiod: Callable[..., Istiod]) -> None:
    _skip_without_iptables()
    _mesh(mesh_dir)
    first, second = Signer("key-1"), Signer("key-2")
    keys = {"jwks": first.jwks()}
    with jwks_server(tmp_path, keys) as (port, root):
        uri = f"https://127.0.0.1:{port}/jwks"
        (mesh_dir / "ra.yaml").write_text(request_authentication((ISSUER, uri)))
        istiod = start_istiod(mesh_dir, env={"SSL_CERT_FILE": str(root), "PILOT_JWT_PUB_KEY_REFRESH_INTERVAL": "1s"})
        with _pod(istiod) as (envoy, run):
            def call(token: str) -> str:
                done = run("curl", "-s", "--max-time", "5", "-w", " %{http_code}", "-H",
                           f"Authorization: Bearer {token}", "http://127.0.0.31:8080/")
                body, _, status = done.stdout.rpartition(" ")
                return f"{status} {body[:60]}"

            # The fetched key verifies its tokens.
            wait_until(lambda: call(first.token()).startswith("200"), 15, "a token of the fetched key accepted")
            assert call(second.token()).startswith("401 Jwks doesn't have key to match kid")
            # Rotated at the issuer: after istiod's refresh, the new key's tokens pass, the old key's fail.
            keys["jwks"] = second.jwks()
            wait_until(lambda: call(second.token()).startswith("200"), 15, "a token of the rotated key accepted")
            assert call(first.token()).startswith("401 Jwks doesn't have key to match kid")

            # An issuer without jwksUri: its OpenID discovery document names the keys.
            discovered = f"https://127.0.0.1:{port}"
            (mesh_dir / "ra.yaml").write_text(request_authentication((ISSUER, uri), (discovered, "")))
            wait_until(lambda: call(second.token(iss=discovered)).startswith("200"), 15,
                       "a token of the issuer found through OpenID discovery accepted")

            # An unreachable URI (nothing listens on port 1): its issuer's tokens all fail.
            down = "https://down.test"
            (mesh_dir / "ra.yaml").write_text(request_authentication((ISSUER, uri), (discovered, ""),
                                                                     (down, "https://127.0.0.1:1/jwks")))
            wait_until(lambda: "failed to fetch JWKS from https://127.0.0.1:1/jwks" in istiod.text(), 15,
                       "istiod's log of the failed fetch")
            # (Envoy tries every key without a kid: the fail-closed key says "verification fails".)
            wait_until(lambda: call(second.token(iss=down)) == "401 Jwt verification fails", 15,
                       "the unreachable issuer's tokens refused")
            assert call(second.token()).startswith("200")
            lines = [l for l in istiod.text().splitlines() if "failed to fetch JWKS from https://127.0.0.1:1" in l]
            print("istiod logged:", lines[0])
            metrics = istiod.get("/metrics", port="monitoring")[1]
            failed = re.search(r"^pilot_jwks_resolver_network_fetch_fail_total (\S+)", metrics, re.M)
            succeeded = re.search(r"^pilot_jwks_resolver_network_fetch_success_total (\S+)", metrics, re.M)
            print("fetches failed:", failed and failed.group(1), "succeeded:", succeeded and succeeded.group(1))
            assert failed is not None and float(failed.group(1)) >= 1
            assert succeeded is not None and float(succeeded.group(1)) >= 2

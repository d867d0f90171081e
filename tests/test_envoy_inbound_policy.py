"""PeerAuthentication and AuthorizationPolicy on a real Envoy sidecar's virtualInbound, through the
same translation as proxyless servers: curl in the sidecar's network namespace, mTLS to itself
through the capture rules, plaintext straight to the app's port."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.envoy_peer import sidecar_envoy
from tests.peers import Istiod, wait_until
from tests.test_envoy_sidecar import _mesh, captured_pod

POLICY = """apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: web, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
"""


def peer_authentication(mode: str) -> str:
    return f"apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {{name: default, namespace: shop}}\nspec: {{mtls: {{mode: {mode}}}}}\n"


def test_envoy_inbound_policy(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (Debian's package) for the capture rules")
    _mesh(mesh_dir)
    (mesh_dir / "pa.yaml").write_text(peer_authentication("STRICT"))
    (mesh_dir / "ap.yaml").write_text(POLICY + """  action: DENY
  rules: [{from: [{source: {principals: [cluster.local/ns/shop/sa/web]}}], to: [{operation: {paths: [/denied*]}}]}]
""")
    istiod = start_istiod(mesh_dir)  # no --mtls: the PeerAuthentication alone makes the port STRICT
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as envoy, \
            captured_pod(istiod, envoy) as run:
        def call(url: str) -> str:
            """`<status> <body>` as curl saw it (000: no HTTP answer)."""
            done = run("curl", "-s", "--max-time", "5", "-w", " %{http_code}", url)
            body, _, status = done.stdout.rpartition(" ")
            line = f"{status} {body[:80]}"
            print(f"curl {url}: {line}")
            return line

        # Through the sidecar (mTLS, identity web): allowed, except the denied path: 403 from RBAC.
        wait_until(lambda: call("http://10.96.0.10/").startswith("200"), 10, "the app's reply through the sidecar")
        assert call("http://10.96.0.10/denied/x") == "403 RBAC: access denied"
        # STRICT: plaintext straight to the app's port is refused.
        assert call("http://127.0.0.31:8080/").startswith("000")

        # PERMISSIVE and an ALLOW for web's identity only: plaintext is served, then denied by RBAC.
        (mesh_dir / "pa.yaml").write_text(peer_authentication("PERMISSIVE"))
        (mesh_dir / "ap.yaml").write_text(POLICY + """  rules: [{from: [{source: {principals: [cluster.local/ns/shop/sa/web]}}]}]
""")
        since = time.monotonic()
        wait_until(lambda: call("http://127.0.0.31:8080/").startswith("403"), 5, "plaintext served, then denied")
        print(f"applied after {time.monotonic() - since:.2f} s")
        # The sidecar's pooled connection to itself keeps the old chain (and its DENY) until Envoy's
        # gradual drain closes it: the chance grows with each response, so this takes seconds.
        since = time.monotonic()
        wait_until(lambda: call("http://10.96.0.10/denied/x").startswith("200"), 60, "web's identity allowed")
        print(f"web's identity allowed on a new connection after {time.monotonic() - since:.2f} s")

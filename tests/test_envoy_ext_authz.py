"""AuthorizationPolicy on a real Envoy sidecar: CUSTOM through an external authorizer (an HTTP
server that decides by a header) from meshConfig extensionProviders, path templates and hosts;
curl in the sidecar's network namespace, plaintext to the app's port through the capture rules."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.envoy_peer import sidecar_envoy
from tests.peers import Istiod, Process, wait_until
from tests.test_envoy_sidecar import _mesh, captured_pod

AUTHZ_SERVICE = """apiVersion: v1
kind: Service
metadata: {name: authz, namespace: shop}
spec:
  clusterIP: 10.96.0.20
  selector: {app: authz}
  ports: [{name: http, port: 8000}, {name: grpc, port: 8001}]
---
apiVersion: v1
kind: Pod
metadata: {name: authz-1, namespace: shop, labels: {app: authz}}
spec:
  serviceAccountName: authz
  containers: [{name: authz, ports: [{containerPort: 8000}, {containerPort: 8001}]}]
status: {phase: Running, podIP: 127.0.0.34, conditions: [{type: Ready, status: "True"}]}
"""
MESH = """extensionProviders:
- name: ext
  envoyExtAuthzHttp:
    service: authz.shop.svc.cluster.local
    port: 8000
    timeout: 5s
    includeRequestHeadersInCheck: [x-ext-authz]
    headersToUpstreamOnAllow: [x-ext-authz-check-result]
    includeRequestBodyInCheck: {maxRequestBytes: 1024, allowPartialMessage: true}
"""
GRPC_MESH = """extensionProviders:
- name: ext
  envoyExtAuthzGrpc: {service: shop/authz.shop.svc.cluster.local, port: 8001, timeout: 5s}
"""


def policies(provider: str) -> str:
    return f"""apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: ext, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: web}}}}
  action: CUSTOM
  provider: {{name: {provider}}}
  rules: [{{to: [{{operation: {{paths: [/ext/*]}}}}]}}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: hosts, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: web}}}}
  action: DENY
  rules: [{{to: [{{operation: {{hosts: ["*.denied.example"]}}}}]}}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: paths, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: web}}}}
  rules: [{{to: [{{operation: {{paths: ["/a/{{*}}/b", "/ext/*", /]}}}}]}}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: audit, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: web}}}}
  action: AUDIT
  rules: [{{to: [{{operation: {{paths: ["/a/{{**}}"]}}}}]}}]
"""


def test_envoy_ext_authz_templates_and_hosts(tmp_path: Path, mesh_dir: Path,
                                             start_istiod: Callable[..., Istiod]) -> None:
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (Debian's package) for the capture rules")
    _mesh(mesh_dir)
    (mesh_dir / "authz.yaml").write_text(AUTHZ_SERVICE)
    (mesh_dir / "ap.yaml").write_text(policies("ext"))
    (tmp_path / "mesh-config.yaml").write_text(MESH)
    istiod = start_istiod(mesh_dir, "--mesh-config", str(tmp_path / "mesh-config.yaml"))
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as envoy, \
            captured_pod(istiod, envoy) as run:
        # The authorizer runs in the pod's namespace too, where Envoy reaches 127.0.0.34 (outbound
        # cluster of the provider's service; plaintext: the pod has no sidecar).
        authz = Process(envoy.netns(sys.executable, "tests/ext_authz_http.py", "127.0.0.34", "8000"), name="ext-authz")
        grpc_authz = Process(envoy.netns(sys.executable, "tests/ext_authz_grpc.py", "127.0.0.34", "8001"),
                             name="grpc-ext-authz")
        try:
            def call(path: str, *headers: str, data: str | None = None) -> str:
                """`<status> <body>` as curl saw it, straight to the app's port (a new connection each);
                a POST of `data` if given."""
                args = [a for h in headers for a in ("-H", h)] + (["-d", data] if data is not None else [])
                done = run("curl", "-s", "--max-time", "5", *args, "-w", " %{http_code}", f"http://127.0.0.31:8080{path}")
                body, _, status = done.stdout.rpartition(" ")
                print(f"curl {path} {headers}: {status} {body[:80]}")
                return f"{status} {body}"

            wait_until(lambda: call("/").startswith("200"), 10, "the app's reply through the sidecar")
            # Path templates: {*} is one segment.
            assert call("/a/x/b").startswith("200")
            assert call("/a/x/y/b") == "403 RBAC: access denied"
            # AUDIT (an RBAC filter with action LOG, which Envoy took) marks /a/** for the access log and
            # denies nothing: /a/x/b above passed it.
            assert '"action": "LOG"' in json.dumps(envoy.config_dump())
            # Hosts: the :authority header, case-insensitively.
            assert call("/", "Host: www.Denied.Example") == "403 RBAC: access denied"
            # CUSTOM: the authorizer decides /ext/*, and only those (the shadow RBAC gates it).
            # (Until the authorizer listens, ext_authz answers 403: statusOnError's default.)
            allowed = wait_until(lambda: (r := call("/ext/x", "x-ext-authz: allow")).startswith("200") and r, 10,
                                 "the authorizer's allow")
            # headersToUpstreamOnAllow: the authorizer's header reaches the app.
            assert allowed.startswith("200") and '"x-ext-authz-check-result": "allowed"' in allowed, allowed
            assert call("/ext/x", "x-ext-authz: deny") == "403 denied by ext_authz"
            # includeRequestBodyInCheck: the authorizer decides by the body Envoy buffered and sent it
            # (allowed, the POST reaches the app, which answers only GET: 501).
            assert call("/ext/x", data="let me in").startswith("501")
            assert call("/ext/x", data="nope") == "403 denied by ext_authz"
            assert call("/a/x/b", "x-ext-authz: deny").startswith("200")
            # The same provider as envoyExtAuthzGrpc (mesh config applied without a restart).
            (tmp_path / "mesh-config.yaml").write_text(GRPC_MESH)
            wait_until(lambda: call("/ext/x", "x-ext-authz: deny") == "403 denied by grpc ext_authz", 10,
                       "the gRPC authorizer's deny")
            allowed = call("/ext/x", "x-ext-authz: allow")
            assert allowed.startswith("200") and '"x-ext-authz-check-result": "allowed-grpc"' in allowed, allowed
            assert call("/a/x/b", "x-ext-authz: deny").startswith("200")
            # An unknown provider denies what the CUSTOM rules match, as istiod.
            (mesh_dir / "ap.yaml").write_text(policies("nobody"))
            wait_until(lambda: call("/ext/x", "x-ext-authz: allow") == "403 RBAC: access denied", 10,
                       "the unknown provider's rules deny")
            assert call("/a/x/b").startswith("200")
        finally:
            grpc_authz.stop()
            authz.stop()

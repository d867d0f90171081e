"""The Sidecar resource on a real Envoy sidecar: its `inboundConnectionPool` caps the connections
the sidecar opens to the app (the pod of tests/test_envoy_authn.py, whose app also serves a TCP echo
on 9000, captured to virtualInbound), and its `outboundTrafficPolicy.egressProxy` takes what no
service claims."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from tests.peers import Istiod, Process, wait_until
from tests.test_envoy_authn import ECHO_SERVICE, TCP_CLIENT, TCP_ECHO, _pod, _skip_without_iptables
from tests.test_envoy_sidecar import _dynamic, _mesh

SIDECAR = """apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: shop}
spec:
  inboundConnectionPool: {tcp: {maxConnections: 1}}
"""
# One connection to the echo that never ends its line: the single-threaded app keeps it, and so does
# Envoy (virtualInbound's listener filters wait for first bytes to pick the TCP chain and connect upstream).
HOLDER = """
import socket, sys, time
connection = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
connection.sendall(b"\\x00hold")  # not HTTP, not TLS: the inspectors decide at once
print('{"open": true}', flush=True)
time.sleep(30)
"""


def test_inbound_connection_pool_caps_the_connections_to_the_app(mesh_dir: Path,
                                                                  start_istiod: Callable[..., Istiod]) -> None:
    _skip_without_iptables()
    _mesh(mesh_dir)
    (mesh_dir / "echo.yaml").write_text(ECHO_SERVICE)
    (mesh_dir / "sidecar.yaml").write_text(SIDECAR)
    istiod = start_istiod(mesh_dir)
    with _pod(istiod, (TCP_ECHO, "127.0.0.31", "9000")) as (envoy, run):
        assert run("iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", "127.0.0.31", "--dport", "9000",
                   "-j", "REDIRECT", "--to-ports", "15006").returncode == 0

        def tcp() -> str:
            return run(sys.executable, "-c", TCP_CLIENT, "127.0.0.31", "9000").stdout.strip()

        wait_until(lambda: tcp() == "b'ping\\n'", 10, "the echo through the sidecar's inbound")
        inbound = _dynamic(envoy.config_dump(), "clusters")["inbound|9000||"]
        assert inbound["circuit_breakers"]["thresholds"][0]["max_connections"] == 1
        holder = Process(envoy.netns(sys.executable, "-c", HOLDER, "127.0.0.31", "9000"), name="holder")
        try:
            assert holder.next_json(10) == {"open": True}
            # The second connection overflows the pool: Envoy closes it without reaching the app.
            wait_until(lambda: tcp() in ("b''", "ConnectionResetError"), 10, "a second connection refused")
            overflow = envoy.get("/stats?filter=inbound.9000.*upstream_cx_overflow")[1]
            print(f"Envoy's stats: {overflow.strip()}")
            assert ": 0" not in overflow and "upstream_cx_overflow" in overflow
        finally:
            holder.stop()
        wait_until(lambda: tcp() == "b'ping\\n'", 10, "the echo once the first connection is gone")


EGRESS = """apiVersion: v1
kind: Service
metadata: {name: egress, namespace: shop}
spec:
  clusterIP: 10.96.0.50
  selector: {app: egress}
  ports: [{name: tcp-proxy, port: 3128}]
---
apiVersion: v1
kind: Pod
metadata: {name: egress-1, namespace: shop, labels: {app: egress}}
spec: {containers: [{name: proxy, ports: [{containerPort: 3128}]}]}
status: {phase: Running, podIP: 127.0.0.45, conditions: [{type: Ready, status: "True"}]}
---
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: shop}
spec:
  outboundTrafficPolicy:
    mode: ALLOW_ANY
    egressProxy: {host: egress.shop.svc.cluster.local, port: {number: 3128}}
"""


def test_egress_proxy_takes_traffic_to_unknown_destinations(mesh_dir: Path,
                                                            start_istiod: Callable[..., Istiod]) -> None:
    """ALLOW_ANY with an egressProxy: an HTTP request for an unknown host (the allow_any route) and a
    connection to an address no service has (virtualOutbound's catch-all) both reach the egress
    proxy (here an echo naming itself) instead of their own destination; known services still work."""
    _skip_without_iptables()
    _mesh(mesh_dir)
    (mesh_dir / "egress.yaml").write_text(EGRESS)
    istiod = start_istiod(mesh_dir)
    echo = (Path(__file__).parent / "http_echo.py").read_text()
    with _pod(istiod, (echo, "127.0.0.45", "3128", "egress-proxy")) as (envoy, run):
        assert run("ip", "addr", "add", "10.96.0.99/32", "dev", "lo").returncode == 0  # an address no service has

        def name(url: str, host: str = "") -> str:
            done = run("curl", "-s", "--max-time", "5", *(["-H", f"Host: {host}"] if host else []), url)
            return json.loads(done.stdout)["name"] if done.stdout.startswith("{") else done.stdout

        wait_until(lambda: name("http://10.96.0.99/", "unknown.example") == "egress-proxy", 15,
                   "an unknown host's request at the egress proxy")
        assert name("http://10.96.0.99:9999/") == "egress-proxy"  # TCP: virtualOutbound's catch-all
        assert json.loads(run("curl", "-s", "--max-time", "5", "http://10.96.0.10/").stdout)["host"] == "10.96.0.10"

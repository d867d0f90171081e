"""Protocol sniffing with a real Envoy 1.40 behind istio-init's capture: a Service port named
without a protocol gets istiod's sniffing listener `<vip>_<port>`, whose HTTP takes the
VirtualService's `http` routes and whose other bytes go through tcp_proxy."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.peers import Istiod, Process, wait_until
from tests.pods import wait_serving
from tests.test_envoy_sidecar import _dynamic
from tests.test_envoy_tcp_egress import connect, pod, pytestmark  # noqa: F401  (skip without iptables)

PLAIN_VIP, RAW_VIP = "10.96.0.60", "10.96.0.61"
SNIFFED = f"""
apiVersion: v1
kind: Service
metadata: {{name: plain, namespace: shop}}
spec:
  clusterIP: {PLAIN_VIP}
  selector: {{app: plain}}
  ports: [{{name: web, port: 80, targetPort: 8080}}]
---
apiVersion: v1
kind: Service
metadata: {{name: rawdb, namespace: shop}}
spec:
  clusterIP: {RAW_VIP}
  selector: {{app: db}}
  ports: [{{port: 5432}}]
""" + "".join(f"""---
apiVersion: v1
kind: Pod
metadata: {{name: plain-{version}, namespace: shop, labels: {{app: plain, version: {version}}}}}
spec: {{containers: [{{name: app, ports: [{{containerPort: 8080}}]}}]}}
status: {{phase: Running, podIP: 127.0.0.5{i}, conditions: [{{type: Ready, status: "True"}}]}}
""" for i, version in ((1, "v1"), (2, "v2"))) + """---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: plain, namespace: shop}
spec:
  host: plain
  subsets: [{name: v1, labels: {version: v1}}, {name: v2, labels: {version: v2}}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: plain, namespace: shop}
spec:
  hosts: [plain]
  http:
  - match: [{headers: {x-version: {exact: v2}}}]
    route: [{destination: {host: plain, subset: v2}}]
  - route: [{destination: {host: plain, subset: v1}}]
"""


def test_an_unnamed_port_gets_http_routing_and_still_carries_raw_tcp(
        mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    with pod(mesh_dir, start_istiod, extra=SNIFFED) as (envoy, run, istiod):
        for vip in (PLAIN_VIP, RAW_VIP):
            assert run("ip", "addr", "add", f"{vip}/32", "dev", "lo").returncode == 0
        backends = [Process(envoy.netns(sys.executable, "-m", "istiod.demo.apps", "http-server", "--address",
                                        f"127.0.0.5{i}:8080", "--name", f"plain-{v}"), name=f"plain-{v}")
                    for i, v in ((1, "v1"), (2, "v2"))]
        try:
            for backend in backends:
                wait_serving(backend)
            wait_until(lambda: len(_dynamic(envoy.config_dump(), "routes").get(
                "plain.shop.svc.cluster.local:80", {}).get("virtual_hosts", [{}])[0].get("routes", [])) == 2,
                20, "the sniffed port's routes in Envoy")
            sniffing = _dynamic(envoy.config_dump(), "listeners")[f"{PLAIN_VIP}_80"]
            assert [f["name"] for f in sniffing["listener_filters"]] == ["envoy.filters.listener.http_inspector"]

            def name(*headers: str) -> Any:
                args = [a for h in headers for a in ("-H", h)]
                done = run("curl", "-s", "--max-time", "10", *args, f"http://{PLAIN_VIP}/")
                assert done.returncode == 0, done.stderr
                return json.loads(done.stdout)["name"]

            assert [name() for _ in range(3)] == ["plain-v1"] * 3
            assert [name("x-version: v2") for _ in range(3)] == ["plain-v2"] * 3
            # A client speaking its own protocol first on a sniffed port: tcp_proxy to the service.
            replies = connect(run, f"{RAW_VIP}:5432", 4)
            assert set(replies) <= {"db-1: hi", "db-2: hi"} and len(replies) == 4, replies  # the pods `app: db`
            print("unnamed port 80: HTTP routed by header (v1 x3, v2 x3); unnamed port 5432: raw TCP echoed", replies)
        finally:
            for backend in backends:
                backend.stop()

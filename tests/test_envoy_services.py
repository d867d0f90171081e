"""Kinds of Service with a real Envoy 1.40 behind istio-init's capture (web-1 in namespace shop).

- Protocol sniffing: a port named without a protocol gets istiod's sniffing listener
  `<vip>_<port>`, whose HTTP takes the VirtualService's `http` routes and whose other bytes go
  through tcp_proxy.
- The `networking.istio.io/exportTo` annotation: `.` hides a Service from other namespaces' proxies.
- ExternalName: an alias of the host it names, reached through the sidecar by its own name.
- Headless: a StatefulSet pod called by its own name through the sidecar's ORIGINAL_DST cluster."""

from __future__ import annotations

import json
import subprocess
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


EXPORTED = """
apiVersion: v1
kind: Service
metadata: {name: secret, namespace: billing, annotations: {networking.istio.io/exportTo: "."}}
spec:
  clusterIP: 10.96.0.62
  selector: {app: plain}
  ports: [{name: http, port: 8081, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: public, namespace: billing, annotations: {networking.istio.io/exportTo: "shop"}}
spec:
  clusterIP: 10.96.0.63
  selector: {app: plain}
  ports: [{name: http, port: 8081, targetPort: 8080}]
---
apiVersion: v1
kind: Pod
metadata: {name: billing-1, namespace: billing, labels: {app: plain}}
spec: {containers: [{name: app, ports: [{containerPort: 8080}]}]}
status: {phase: Running, podIP: 127.0.0.54, conditions: [{type: Ready, status: "True"}]}
"""


def test_export_to_dot_hides_a_service_from_another_namespaces_proxy(
        mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    # REGISTRY_ONLY: what the proxy does not know gets block_all's 502 (under ALLOW_ANY it would
    # pass through to the VIP itself, here an address of the pod's own).
    with pod(mesh_dir, start_istiod, "--outbound-traffic-policy", "REGISTRY_ONLY",
             extra=SNIFFED + "---" + EXPORTED) as (envoy, run, istiod):
        for vip in ("10.96.0.62", "10.96.0.63"):
            assert run("ip", "addr", "add", f"{vip}/32", "dev", "lo").returncode == 0
        backend = Process(envoy.netns(sys.executable, "-m", "istiod.demo.apps", "http-server", "--address",
                                      "127.0.0.54:8080", "--name", "billing-1"), name="billing-1")
        try:
            wait_serving(backend)
            clusters = set(_dynamic(envoy.config_dump(), "clusters"))
            assert "outbound|8081||public.billing.svc.cluster.local" in clusters
            assert not any("secret.billing" in name for name in clusters)
            hosts = [h["name"] for h in _dynamic(envoy.config_dump(), "routes")["8081"]["virtual_hosts"]]
            assert hosts == ["public.billing.svc.cluster.local:8081", "block_all"]

            def call(host: str, vip: str) -> subprocess.CompletedProcess[str]:
                return run("curl", "-s", "--max-time", "5", "-o", "/dev/null", "-w", "%{http_code}", "-H",
                           f"Host: {host}", f"http://{vip}:8081/")

            assert call("public.billing", "10.96.0.63").stdout == "200"
            hidden = call("secret.billing", "10.96.0.62")
            assert hidden.stdout == "502", hidden  # unknown to this proxy
            print(f"exportTo shop: 200; exportTo '.': {hidden.stdout} (block_all: not in the proxy's registry)")
        finally:
            backend.stop()


EXTERNAL = """
apiVersion: v1
kind: Service
metadata: {name: ext, namespace: shop}
spec:
  type: ExternalName
  externalName: echo.external.test
  ports: [{name: http, port: 8090}]
"""
EXT = "ext.shop.svc.cluster.local"


def test_an_external_name_service_is_called_through_the_sidecar(
        mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    """`ext` names the ServiceEntry host echo.external.test (DNS-resolved to localhost, where
    echo-external answers): as istiod's alias, its names route to that host's cluster."""
    with pod(mesh_dir, start_istiod, extra=EXTERNAL) as (envoy, run, istiod):
        assert not any("ext.shop" in name for name in _dynamic(envoy.config_dump(), "clusters"))
        # The app resolved the name (in a cluster, DNS's CNAME to the host it names) to that
        # host's address, which the capture sends to Envoy.
        done = run("curl", "-s", "--max-time", "10", "--resolve", f"{EXT}:8090:10.96.5.2", f"http://{EXT}:8090/")
        assert done.returncode == 0 and json.loads(done.stdout)["name"] == "echo-external", done
        print(f"ExternalName {EXT} -> echo.external.test through the sidecar: {json.loads(done.stdout)}")


HEADLESS = """
apiVersion: v1
kind: Service
metadata: {name: hl, namespace: shop}
spec:
  clusterIP: None
  selector: {app: hl}
  ports: [{name: http, port: 8097}]
""" + "".join(f"""---
apiVersion: v1
kind: Pod
metadata:
  name: hl-{i}
  namespace: shop
  labels: {{app: hl}}
  ownerReferences: [{{apiVersion: apps/v1, kind: StatefulSet, name: hl, uid: u1, controller: true}}]
spec: {{hostname: hl-{i}, subdomain: hl, containers: [{{name: app, ports: [{{containerPort: 8097}}]}}]}}
status: {{phase: Running, podIP: 10.96.0.8{i}, conditions: [{{type: Ready, status: "True"}}]}}
""" for i in range(2))


def test_a_statefulset_pod_is_called_by_its_own_name(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    with pod(mesh_dir, start_istiod, extra=HEADLESS) as (envoy, run, istiod):
        # The pods' addresses are in the captured range; Envoy (root here, as are the apps) leaves
        # uncaptured, the client runs as another user and is captured.
        assert run("iptables", "-t", "nat", "-I", "OUTPUT", "1", "-m", "owner", "--uid-owner", "0",
                   "-j", "RETURN").returncode == 0
        backends = []
        try:
            for i in range(2):
                assert run("ip", "addr", "add", f"10.96.0.8{i}/32", "dev", "lo").returncode == 0
                backends.append(Process(envoy.netns(sys.executable, "-m", "istiod.demo.apps", "http-server", "--address",
                                                    f"10.96.0.8{i}:8097", "--name", f"hl-{i}"), name=f"hl-{i}"))
                wait_serving(backends[-1])
            cluster = _dynamic(envoy.config_dump(), "clusters")["outbound|8097||hl.shop.svc.cluster.local"]
            assert cluster["type"] == "ORIGINAL_DST"
            before = int(dict(line.split(": ") for line in envoy.get(
                "/stats?filter=outbound.8097..hl.shop.svc.cluster.local.upstream_rq_total")[1].splitlines()).popitem()[1])
            answered = []
            for i in (1, 0, 1):
                host = f"hl-{i}.hl.shop.svc.cluster.local"
                done = run("setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "curl", "-s", "--max-time", "10",
                           "--resolve", f"{host}:8097:10.96.0.8{i}", f"http://{host}:8097/")
                assert done.returncode == 0, done
                answered.append(json.loads(done.stdout)["name"])
            assert answered == ["hl-1", "hl-0", "hl-1"]
            after = int(dict(line.split(": ") for line in envoy.get(
                "/stats?filter=outbound.8097..hl.shop.svc.cluster.local.upstream_rq_total")[1].splitlines()).popitem()[1])
            assert after - before == 3  # through the sidecar's headless cluster, not around it
            print(f"StatefulSet pods by name through the sidecar: {answered}")
        finally:
            for backend in backends:
                backend.stop()

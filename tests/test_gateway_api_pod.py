"""A Gateway API gateway as the cluster runs it: `istiod agent proxy router` and its Envoy inside the
gateway's pod (a network namespace on the node's bridge, uid 1337, istiod reached through a tunnel
on 15012 with a token-issued certificate), its labels those of its Pod in the registry. A client pod
calls the gateway pod's address; the HTTPRoute sends the request to the backend pod. istiod runs on
loopback with the config in this file."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from istiod.demo.pods import Node, Sidecar, sweep
from tests.peers import Istiod, Process, free_port, wait_until
from tests.pods import app, requires_root, shared_dir, uids, wait_serving

pytestmark = requires_root

GATEWAY_IP, ECHO_IP, CLIENT_IP = "10.44.0.2", "10.44.0.3", "10.44.0.4"
TOKEN = "ingress-s3cret"
GROUP = "gateway.networking.k8s.io"


def _pod(name: str, namespace: str, labels: dict[str, str], ip: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"serviceAccountName": "ingress" if namespace == "istio-ingress" else "default",
                     "containers": [{"name": "app", "ports": [{"containerPort": 8080}]}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


MESH = [
    {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": "shop"},
     "spec": {"clusterIP": "10.96.0.40", "selector": {"app": "echo"}, "ports": [{"name": "http", "port": 8080}]}},
    _pod("echo-1", "shop", {"app": "echo"}, ECHO_IP),
    {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web-istio", "namespace": "istio-ingress"},
     "spec": {"clusterIP": "10.96.0.41", "selector": {f"{GROUP}/gateway-name": "web"},
              "ports": [{"name": "http", "port": 8080}]}},
    _pod("web-1", "istio-ingress", {f"{GROUP}/gateway-name": "web"}, GATEWAY_IP),
    {"apiVersion": f"{GROUP}/v1", "kind": "Gateway", "metadata": {"name": "web", "namespace": "istio-ingress"},
     "spec": {"gatewayClassName": "istio", "listeners": [
         {"name": "http", "port": 8080, "protocol": "HTTP", "allowedRoutes": {"namespaces": {"from": "All"}}}]}},
    {"apiVersion": f"{GROUP}/v1", "kind": "HTTPRoute", "metadata": {"name": "shop", "namespace": "shop"},
     "spec": {"parentRefs": [{"name": "web", "namespace": "istio-ingress"}], "hostnames": ["web.example.com"],
              "rules": [{"filters": [{"type": "RequestHeaderModifier",
                                      "requestHeaderModifier": {"set": [{"name": "x-via", "value": "gateway-pod"}]}}],
                         "backendRefs": [{"name": "echo", "port": 8080}]}]}},
]


@pytest.fixture
def node() -> Iterator[Node]:
    sweep()
    made = Node()
    try:
        yield made
    finally:
        made.delete()


def test_the_gateway_runs_in_its_pod_and_routes_a_client_pod_to_the_backend_pod(
        tmp_path: Path, node: Node, processes: list[Process]) -> None:
    config = tmp_path / "mesh"
    config.mkdir()
    (config / "mesh.yaml").write_text(yaml.safe_dump_all(MESH))
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({TOKEN: "istio-ingress/ingress"}))
    secure_port = free_port()
    istiod = Istiod(tmp_path, "--config-dir", str(config), "--poll-interval", "100ms", "--ca-static-tokens", str(tokens),
                    "--secure-grpc-addr", f"127.0.0.1:{secure_port}")
    processes.append(istiod)
    home = shared_dir("sp-gwpod-")
    try:
        gateway_pod, echo_pod, client = (node.add_pod("gw", 2), node.add_pod("echo", 3), node.add_pod("client", 4))
        backend = app(echo_pod, "http-server", "--address", f"{ECHO_IP}:8080", "--name", "echo-1", name="echo-1")
        processes.append(backend)
        wait_serving(backend)
        gateway = Sidecar(gateway_pod, home / "web-1", "web-1", "istio-ingress", "ingress", GATEWAY_IP)
        gateway.prepare(istiod.root_cert, TOKEN)
        tunnel = Process(gateway.tunnel_command(f"127.0.0.1:{secure_port}"), name="tunnel-web-1")
        processes.append(tunnel)
        wait_serving(tunnel)
        agent = Process(gateway.agent_command("router", "--termination-drain-duration", "1s"), name="agent-web-1")
        processes.append(agent)

        def call() -> tuple[int, str]:
            done = client.run("curl", "-s", "-m", "5", "-w", "\n%{http_code}", "-H", "Host: web.example.com",
                              f"http://{GATEWAY_IP}:8080/through-the-pod", timeout=10)
            body, _, status = done.stdout.rpartition("\n")
            return int(status or 0), body

        try:
            status, body = wait_until(lambda: (r := call())[0] == 200 and r, 60, "the client pod through the gateway pod")
        except AssertionError:
            print(agent.log()[-4000:])
            raise
        print("client pod -> gateway pod -> backend pod:", status, body)
        answer = json.loads(body)
        assert answer["name"] == "echo-1" and answer["path"] == "/through-the-pod"
        assert answer["headers"].get("x-via") == "gateway-pod"  # the route's filter, applied in the pod
        # A host no route takes: the gateway's own 404, from inside the pod.
        done = client.run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "Host: other.example.com",
                          f"http://{GATEWAY_IP}:8080/", timeout=10)
        assert done.stdout == "404"
        pids = subprocess.run(["ip", "netns", "pids", gateway_pod.name], capture_output=True, text=True,
                              timeout=10).stdout.split()
        envoys = [pid for pid in pids if Path(f"/proc/{pid}/comm").read_text().strip() == "envoy"]
        assert envoys and all(uids(pid)[0] == "1337" for pid in envoys)  # the proxy's uid, as in Istio's gateway pods
    finally:
        for process in reversed(processes):  # before the node's namespaces go
            if process is not istiod:
                process.stop()
        shutil.rmtree(home, ignore_errors=True)

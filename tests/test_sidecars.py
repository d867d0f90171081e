"""Envoy sidecars carrying real traffic between pods (network namespaces), configured by istiod.

istiod runs on loopback with deploy/sidecars/mesh.yaml; pods a-1 and b-1 each run `istiod agent
proxy` and Envoy as uid 1337 behind istio-init's capture, reaching istiod through a tunnel. A pod
without a sidecar (`plain`) and an address outside the mesh (`outside`) sit on the same bridge.
The pods and Envoys are shared by the module's tests; a test that needs other istiod flags restarts
istiod on the same ports and the agents reconnect without restarting Envoy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from istiod.demo.pods import ENVOY_UID, Netns, Node, Sidecar, sweep
from tests.conftest import synced
from tests.peers import ROOT, Istiod, Process, free_port, wait_until
from tests.pods import admin, app, call, requires_root, shared_dir, stats, uids, wait_envoy_ready, wait_serving

pytestmark = requires_root

NAMESPACE = "sidecars"
HOST = f"b.{NAMESPACE}.svc.cluster.local"
VIP = "10.96.0.3"
A_ID = f"spiffe://cluster.local/ns/{NAMESPACE}/sa/a"
TOKENS = {"a-s3cret": f"{NAMESPACE}/a", "b-s3cret": f"{NAMESPACE}/b"}
OUTSIDE_IP = "10.44.0.200"
OUTSIDE_TCP_PORT = 9100  # a port no Service has
B_UNDECLARED_TCP, B_UNDECLARED_HTTP = 9101, 8081  # ports b-1's app serves that its Service does not name
PASSTHROUGH = "cluster.PassthroughCluster.upstream_cx_total"
BLACKHOLE = "cluster.BlackHoleCluster.upstream_cx_none_healthy"
XDS_TYPES = ("cluster", "listener", "endpoint", "route")
SECOND_BACKEND = f"""\
apiVersion: v1
kind: Pod
metadata:
  name: b-2
  namespace: {NAMESPACE}
  labels: {{app: b}}
spec:
  serviceAccountName: b
  containers: [{{name: app, image: demo/echo, ports: [{{containerPort: 8080}}]}}]
status:
  phase: Running
  podIP: 10.44.0.4
  conditions: [{{type: Ready, status: "True"}}]
"""


def proxy_id(pod: str, ip: str) -> str:
    return f"sidecar~{ip}~{pod}.{NAMESPACE}~{NAMESPACE}.svc.cluster.local"


class SidecarMesh:
    def __init__(self, workdir: Path, home: Path, node: Node) -> None:
        self.workdir = workdir
        self.config = workdir / "mesh"
        self.config.mkdir()
        shutil.copy(ROOT / "deploy" / "sidecars" / "mesh.yaml", self.config / "mesh.yaml")
        self.tokens = workdir / "tokens.json"
        self.tokens.write_text(json.dumps(TOKENS))
        self.secure_port = free_port()  # fixed across restarts: the tunnels point at it
        self.home = home
        self.node = node
        self.processes: list[Process] = []
        self.istiod: Istiod | None = None
        self.flags: tuple[str, ...] = ()
        hosts = {HOST: VIP, f"b.{NAMESPACE}": VIP}
        self.a = node.add_pod("a", 2, hosts)
        self.b = node.add_pod("b", 3, hosts)
        self.plain = node.add_pod("plain", 5)
        self.outside = node.add_pod("outside", 200)
        self.agents: dict[str, Process] = {}
        self.outside_http: Process  # an HTTP server at an address outside the mesh

    def start(self, process: Process) -> Process:
        self.processes.append(process)
        return process

    def start_istiod(self, *flags: str) -> Istiod:
        if self.istiod is not None:
            self.istiod.stop()
        self.istiod = Istiod(self.workdir, "--config-dir", str(self.config), "--poll-interval", "100ms",
                             "--ca-static-tokens", str(self.tokens),
                             "--secure-grpc-addr", f"127.0.0.1:{self.secure_port}", *flags)
        self.flags = flags
        return self.istiod

    def start_sidecar(self, pod: Netns, name: str, ip: str, service_account: str, token: str) -> None:
        assert self.istiod is not None
        sidecar = Sidecar(pod, self.home / name, name, NAMESPACE, service_account, ip)
        sidecar.prepare(self.istiod.root_cert, token)
        capture = subprocess.run(sidecar.capture_command(), capture_output=True, text=True, timeout=30)
        assert capture.returncode == 0, capture.stderr
        tunnel = self.start(Process(sidecar.tunnel_command(f"127.0.0.1:{self.secure_port}"), name=f"tunnel-{name}"))
        wait_serving(tunnel)
        self.agents[name] = self.start(Process(sidecar.agent_command("--termination-drain-duration", "1s"),
                                                     name=f"agent-{name}"))

    def use(self, *flags: str) -> Istiod:
        """istiod with these flags (restarted if it has others), both Envoys synced with it."""
        if flags != self.flags or self.istiod is None:
            self.start_istiod(*flags)
        istiod = self.istiod
        assert istiod is not None
        wait_until(lambda: synced(istiod, proxy_id("a-1", "10.44.0.2"), XDS_TYPES)
                   and synced(istiod, proxy_id("b-1", "10.44.0.3"), XDS_TYPES), 60, "both Envoys synced with istiod")
        return istiod

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        if self.istiod is not None:
            self.istiod.stop()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarMesh]:
    sweep()
    home = shared_dir("sp-pods-")
    node = Node()
    mesh = None
    try:
        mesh = SidecarMesh(tmp_path_factory.mktemp("sidecars"), home, node)
        mesh.start_istiod()
        mesh.outside_http = mesh.start(app(mesh.outside, "http-server", "--address", f"{OUTSIDE_IP}:8080",
                                           "--name", "outside", name="outside-http"))
        mesh.start_sidecar(mesh.a, "a-1", "10.44.0.2", "a", "a-s3cret")
        mesh.start_sidecar(mesh.b, "b-1", "10.44.0.3", "b", "b-s3cret")
        b_apps = [
            mesh.start(app(mesh.b, "http-server", "--address", "10.44.0.3:8080", "--name", "b-1", name="b-http")),
            mesh.start(app(mesh.b, "server", "--address", "10.44.0.3:7070", "--name", "b-1", name="b-grpc",
                           module="istiod.demo")),
            mesh.start(app(mesh.b, "tcp-echo", "--address", "10.44.0.3:9000", "--name", "b-1", name="b-tcp")),
            mesh.start(app(mesh.b, "tcp-echo", "--address", f"10.44.0.3:{B_UNDECLARED_TCP}", "--name", "b-1",
                           name="b-tcp-undeclared")),
            mesh.start(app(mesh.b, "http-server", "--address", f"10.44.0.3:{B_UNDECLARED_HTTP}", "--name", "b-1",
                           name="b-http-undeclared")),
            mesh.start(app(mesh.outside, "tcp-echo", "--address", f"{OUTSIDE_IP}:{OUTSIDE_TCP_PORT}",
                           "--name", "outside", name="outside-tcp")),
            mesh.outside_http,
        ]
        for process in b_apps:
            wait_serving(process)
        for pod, name in ((mesh.a, "a-1"), (mesh.b, "b-1")):
            wait_envoy_ready(pod, mesh.agents[name], timeout=60)
        mesh.use()
        yield mesh
    finally:
        if mesh is not None:
            mesh.stop()
            for name, agent in mesh.agents.items():
                print(f"--- agent and Envoy of {name}:\n{agent.log()}")
        node.delete()
        shutil.rmtree(home, ignore_errors=True)


# Per protocol: the port, a client call from a-1, what b-1's app answers, and the Envoy counter.
PROTOCOLS = {
    "http": (8080, ("http-get", f"http://{HOST}:8080/hello"), "b-1", "upstream_rq_total"),
    "grpc": (7070, ("grpc-call", f"dns:///{HOST}:7070"), "b-1 10.44.0.3:7070", "upstream_rq_total"),
    "tcp": (9000, ("tcp-call", f"{HOST}:9000", "hello"), "b-1: hello", "upstream_cx_total"),
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_traffic_through_both_envoys(mesh: SidecarMesh, protocol: str) -> None:
    mesh.use()
    port, client, answer, counter = PROTOCOLS[protocol]
    reply = call(mesh.a, *client)
    print(f"a-1 got over {protocol}:", reply)
    assert reply["ok"], reply
    assert (reply["body"]["name"] if protocol == "http" else reply["reply"]) == answer
    outbound = f"cluster.outbound|{port}||{HOST}.{counter}"
    inbound = f"cluster.inbound|{port}||.{counter}"
    print("A's Envoy:", stats(mesh.a, outbound), "B's Envoy:", stats(mesh.b, inbound))
    assert stats(mesh.a, outbound)[outbound] >= 1
    assert stats(mesh.b, inbound)[inbound] >= 1


def test_envoy_runs_as_1337_inside_each_pod(mesh: SidecarMesh) -> None:
    for pod in (mesh.a, mesh.b):
        pids = subprocess.run(["ip", "netns", "pids", pod.name], capture_output=True, text=True, timeout=10).stdout.split()
        commands = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids}
        envoys = [pid for pid, command in commands.items() if command == "envoy"]
        assert len(envoys) == 1, commands
        assert uids(envoys[0]) == [str(ENVOY_UID)] * 4


def test_agent_status_ports_answer_on_the_pod_ip_uncaptured(mesh: SidecarMesh) -> None:
    mesh.use()
    inbound_before = stats(mesh.b, "cluster.inbound|8080||.upstream_rq_total")
    ready = call(mesh.plain, "http-get", "http://10.44.0.3:15021/healthz/ready")
    print("b-1's /healthz/ready from another pod:", ready.get("status"), ready.get("body"))
    assert ready["status"] == 200, ready
    metrics = call(mesh.plain, "http-get", "http://10.44.0.3:15020/stats/prometheus")
    assert metrics["status"] == 200, metrics
    # Envoy's own stats, merged by b-1's agent: the inbound cluster's traffic is there.
    assert 'cluster_name="inbound|8080||"' in metrics["body"]
    assert stats(mesh.b, "cluster.inbound|8080||.upstream_rq_total") == inbound_before  # not through Envoy


def test_b_sees_a_spiffe_identity(mesh: SidecarMesh) -> None:
    mesh.use()
    reply = call(mesh.a, "http-get", f"http://{HOST}:8080/who")
    assert reply["ok"], reply
    xfcc = reply["body"]["headers"].get("x-forwarded-client-cert", "")
    print("x-forwarded-client-cert:", xfcc)
    assert f"URI={A_ID}" in xfcc


def test_plaintext_client_without_sidecar_reaches_b_permissive(mesh: SidecarMesh) -> None:
    mesh.use()
    reply = call(mesh.plain, "http-get", "http://10.44.0.3:8080/plain")
    print("plain got:", reply)
    assert reply["ok"], reply
    assert reply["body"]["name"] == "b-1" and "x-forwarded-client-cert" not in reply["body"]["headers"]


def test_undeclared_ports_pass_through_b_inbound_by_protocol(mesh: SidecarMesh) -> None:
    """virtualInbound's catch-all chains: what the HTTP inspector recognises goes through an HCM,
    the rest through tcp_proxy, both to InboundPassthroughCluster (the port the client called)."""
    mesh.use()
    tcp, http = "tcp.InboundPassthroughCluster.downstream_cx_total", "http.InboundPassthroughCluster.downstream_rq_total"

    def counts() -> dict[str, int]:
        return {name: stats(mesh.b, name).get(name, 0) for name in (tcp, http)}

    before = counts()
    for client in (mesh.plain, mesh.a):  # plaintext from outside the mesh, and from a-1 (passthrough is plaintext)
        reply = call(client, "tcp-call", f"10.44.0.3:{B_UNDECLARED_TCP}", "hello")
        assert reply == {"ok": True, "reply": "b-1: hello"}, reply
        reply = call(client, "http-get", f"http://10.44.0.3:{B_UNDECLARED_HTTP}/undeclared")
        assert reply["ok"] and reply["body"]["name"] == "b-1", reply
    after = counts()
    print("b-1's catch-all chains:", before, "->", after)
    # The HTTP calls took the HCM chain, the TCP ones tcp_proxy.
    assert (after[http] - before[http], after[tcp] - before[tcp]) == (2, 2)


def test_non_http_bytes_on_an_http_port_pass_through_untouched(mesh: SidecarMesh) -> None:
    """a-1's 0.0.0.0_8080 takes only what the HTTP inspector finds is HTTP; a client speaking
    something else reaches its original destination by the listener's PassthroughFilterChain."""
    mesh.use()
    routed = "http.outbound_0.0.0.0_8080.downstream_rq_total"
    before = {routed: 0, PASSTHROUGH: 0, **stats(mesh.a, routed), **stats(mesh.a, PASSTHROUGH)}
    reply = call(mesh.a, "tcp-call", f"{OUTSIDE_IP}:8080", "hello")
    print("a-1 sent 'hello' to the outside HTTP server's port 8080:", reply)
    assert "400" in reply.get("reply", ""), reply  # the server itself read the bytes and refused them
    after = {routed: 0, **stats(mesh.a, routed), **stats(mesh.a, PASSTHROUGH)}
    assert after[PASSTHROUGH] > before[PASSTHROUGH] and after[routed] == before[routed]


def test_proxy_status_and_proxy_config(mesh: SidecarMesh) -> None:
    istiod = mesh.use()

    def cli(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "istiod", *args, "--istiod", istiod.url("monitoring")],
                                cwd=ROOT, capture_output=True, text=True, timeout=30)
        print(f"$ istiod {' '.join(args)}\n{result.stdout}{result.stderr}")
        assert result.returncode == 0, result.stderr
        return result.stdout

    rows = {line.split()[0]: line.split() for line in cli("proxy-status").splitlines()}
    for pod in ("a-1.sidecars", "b-1.sidecars"):
        assert rows[pod][2:6] == ["SYNCED"] * 4, rows[pod]
    listeners = cli("proxy-config", "listeners", "a-1.sidecars")
    assert "virtualOutbound" in listeners and "virtualInbound" in listeners
    clusters = cli("proxy-config", "clusters", "a-1.sidecars")
    assert HOST in clusters and "PassthroughCluster" in clusters
    routes = cli("proxy-config", "routes", "a-1.sidecars")
    assert "8080" in routes


def test_second_backend_gets_traffic_and_its_removal_is_followed(mesh: SidecarMesh) -> None:
    mesh.use()
    second = mesh.node.add_pod("b2", 4)
    backend = mesh.start(app(second, "http-server", "--address", "10.44.0.4:8080", "--name", "b-2", name="b2-http"))
    wait_serving(backend)
    client = mesh.start(app(mesh.a, "http-get", f"http://{HOST}:8080/", "--count", "0", "--interval", "0.05",
                            "--timeout", "2", name="a-client"))
    replies: list[str] = []  # who answered each call, in order

    def answered(name: str, last: int = 1) -> bool:
        replies.extend(line["body"]["name"] if line.get("ok") else "error" for line in client.drain())
        return len(replies) >= last and set(replies[-last:]) == {name}

    try:
        wait_until(lambda: answered("b-1"), 20, "a-1's calls to b")
        added = time.monotonic()
        (mesh.config / "b-2.yaml").write_text(SECOND_BACKEND)
        wait_until(lambda: answered("b-2"), 20, "a reply from b-2")
        print(f"b-2 answered {time.monotonic() - added:.2f}s after its Pod was written")
        (mesh.config / "b-2.yaml").unlink()
        removed = time.monotonic()
        replies.clear()
        wait_until(lambda: answered("b-1", last=20), 20, "20 calls in a row answered by b-1 alone")
        print(f"b-2 left the rotation: 20 calls in a row to b-1 {time.monotonic() - removed:.2f}s after its Pod's "
              f"removal; answers since: {replies}")
    finally:
        (mesh.config / "b-2.yaml").unlink(missing_ok=True)
        client.stop()
        backend.stop()


def test_service_deletion_is_followed(mesh: SidecarMesh) -> None:
    mesh.use()
    service = (mesh.config / "mesh.yaml").read_text()
    cluster = f"outbound|8080||{HOST}"
    documents = service.split("\n---\n")
    (mesh.config / "mesh.yaml").write_text("\n---\n".join(d for d in documents if "kind: Service\n" not in d))
    try:
        wait_until(lambda: cluster not in admin(mesh.a, "/clusters"), 20, "A's Envoy to drop the Service's cluster")
        # The VIP is now just an address: A's call passes through to it and finds nothing.
        reply = call(mesh.a, "http-get", f"http://{HOST}:8080/gone")
        print("a-1 after the Service's deletion:", reply)
        assert not reply["ok"]
    finally:
        (mesh.config / "mesh.yaml").write_text(service)
    wait_until(lambda: call(mesh.a, "http-get", f"http://{HOST}:8080/back")["ok"], 20, "the Service to come back")


def test_allow_any_passes_an_address_outside_the_mesh(mesh: SidecarMesh) -> None:
    mesh.use()
    reply = call(mesh.a, "http-get", f"http://{OUTSIDE_IP}:8080/")
    print("a-1 to the outside address, ALLOW_ANY:", reply)
    assert reply["ok"] and reply["body"]["name"] == "outside", reply
    reply = call(mesh.a, "tcp-call", f"{OUTSIDE_IP}:{OUTSIDE_TCP_PORT}", "hello")
    assert reply == {"ok": True, "reply": "outside: hello"}
    assert stats(mesh.a, PASSTHROUGH)[PASSTHROUGH] >= 1


def test_registry_only_blackholes_an_address_outside_the_mesh(mesh: SidecarMesh) -> None:
    mesh.use("--outbound-traffic-policy", "REGISTRY_ONLY")
    before = len(mesh.outside_http.output)
    # HTTP on a mesh port: the route's catch-all virtual host answers 502 instead of passing through.
    reply = call(mesh.a, "http-get", f"http://{OUTSIDE_IP}:8080/")
    print("a-1 to the outside address over HTTP, REGISTRY_ONLY:", reply)
    assert reply.get("status") == 502 and reply["headers"]["server"] == "envoy", reply
    # TCP on another port: virtualOutbound's default chain goes to BlackHoleCluster.
    reply = call(mesh.a, "tcp-call", f"{OUTSIDE_IP}:{OUTSIDE_TCP_PORT}", "hello")
    print("a-1 to the outside address over TCP, REGISTRY_ONLY:", reply)
    assert not reply["ok"], reply
    assert stats(mesh.a, BLACKHOLE)[BLACKHOLE] >= 1
    assert len(mesh.outside_http.output) == before  # the outside server saw nothing
    assert call(mesh.a, "http-get", f"http://{HOST}:8080/")["ok"]  # the mesh itself still works


def test_strict_mtls_refuses_plaintext_and_a_still_works(mesh: SidecarMesh) -> None:
    mesh.use("--mtls")
    reply = call(mesh.plain, "http-get", "http://10.44.0.3:8080/plain")
    print("plain got, with --mtls:", reply)
    assert not reply["ok"], reply
    # a-1's sidecar may still hold the config from before the restart for a moment: its calls reach b over
    # mTLS (with a's identity in XFCC) once it has the new one.
    replies: list[dict[str, Any]] = []

    def strict_call_ok() -> bool:
        replies.append(call(mesh.a, "http-get", f"http://{HOST}:8080/strict"))
        last = replies[-1]
        return bool(last["ok"]) and f"URI={A_ID}" in last["body"]["headers"].get("x-forwarded-client-cert", "")

    wait_until(strict_call_ok, 20, "a-1's call to b over mTLS with its identity")

"""`istiod cni` with the real ztunnel in shared (in-pod) mode: pods are network namespaces on a node
namespace, ztunnel runs in the node namespace and takes each captured pod over ZDS; the CNI plugin
is run the way a container runtime runs it.

What ztunnel has is read from its admin `/config_dump` (`workloadState`) and from the listeners it
opens inside each pod (15001, 15006, 15008); the capture from the pod's iptables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from istiod.demo.pods import Netns, Node
from tests.peers import ROOT, Process, wait_until
from tests.pods import requires_root

pytestmark = requires_root
ZTUNNEL_BUILD = Path("/work/shared/ztunnel/build.sh")
NODE = "node-1"
INPOD_PORTS = {15001, 15006, 15008}


def ztunnel_binary() -> str:
    """The real ztunnel (built once, then cached by its build script)."""
    done = subprocess.run(["bash", str(ZTUNNEL_BUILD)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def pod_yaml(name: str, ip: str, uid: str, mode: str | None = None, node: str = NODE) -> dict[str, Any]:
    labels = {"app": name} | ({"istio.io/dataplane-mode": mode} if mode else {})
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "demo", "uid": uid, "labels": labels},
        "spec": {"nodeName": node, "serviceAccountName": "sa-" + name, "containers": [{"name": "app", "image": "x"}]},
        "status": {"phase": "Running"},
    }
    if ip:
        pod["status"]["podIP"] = ip
    return pod


class Mesh:
    """The config dir, the node and its pods, the agent, and ztunnel; all removed at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.config = tmp / "config"
        self.config.mkdir()
        self.netns_dir = tmp / "netns"
        self.netns_dir.mkdir()
        self.run_dir = tmp / "run"
        self.conf_dir = tmp / "net.d"
        self.conf_dir.mkdir()
        self.bin_dir = tmp / "bin"
        self.bin_dir.mkdir()
        self.socket = tmp / "ztunnel.sock"
        self.write("namespace", {"apiVersion": "v1", "kind": "Namespace",
                                 "metadata": {"name": "demo", "labels": {"istio.io/dataplane-mode": "ambient"}}})
        (self.conf_dir / "10-bridge.conflist").write_text(json.dumps(
            {"cniVersion": "1.0.0", "name": "k8s-pod-network", "plugins": [{"type": "bridge"}]}))
        self.node = Node("10.61")
        self.pods: dict[str, Netns] = {}
        self.agent: Process | None = None
        self.ztunnel: Process | None = None

    def write(self, name: str, body: dict[str, Any]) -> None:
        staged = self.config / f".{name}.tmp"
        staged.write_text(json.dumps(body))
        staged.rename(self.config / f"{name}.yaml")

    def add_pod(self, name: str, host: int) -> Netns:
        pod = self.pods[name] = self.node.add_pod(name, host)
        # Only this test's namespaces are searched by IP: never another test's pod of the same IP.
        (self.netns_dir / name).symlink_to(f"/var/run/netns/{pod.name}")
        return pod

    def start_agent(self) -> Process:
        self.agent = Process([sys.executable, "-m", "istiod", "cni", "--node-name", NODE,
                              "--config-dir", str(self.config), "--ztunnel-uds-address", str(self.socket),
                              "--cni-agent-run-dir", str(self.run_dir), "--mounted-cni-net-dir", str(self.conf_dir),
                              "--cni-bin-dir", str(self.bin_dir), "--netns-dir", str(self.netns_dir),
                              "--resync", "500ms", "--zds-ack-timeout", "5s"], name="istiod cni")
        wait_until(lambda: "ready" in self.agent.text() or self.agent.proc.poll() is not None, 30, "the agent ready")  # type: ignore[union-attr]
        assert self.agent.proc.poll() is None, self.agent.log()
        return self.agent

    def start_ztunnel(self, binary: str) -> Process:
        workdir = self.tmp / "ztunnel"
        workdir.mkdir(exist_ok=True)
        env = {"INPOD_UDS": str(self.socket), "FAKE_CA": "true", "NODE_NAME": NODE, "POD_NAME": "ztunnel-1",
               "POD_NAMESPACE": "istio-system", "RUST_LOG": "info",
               # No xDS: our istiod does not serve ztunnel's types on this branch, and ztunnel only
               # connects to ZDS once its first xDS state arrived (or when it has no xDS server).
               "XDS_ADDRESS": ""}
        # From an empty working directory: ztunnel reads ./var/run/secrets/... by default.
        self.ztunnel = Process(self.node.ns.exec_args("env", "-C", str(workdir), binary), env=env, name="ztunnel")
        return self.ztunnel

    def stop(self, process: Process | None) -> None:
        if process is not None:
            process.stop()

    def workload_state(self) -> dict[str, Any]:
        done = self.node.ns.run("curl", "-s", "--max-time", "5", "http://127.0.0.1:15000/config_dump")
        try:
            return json.loads(done.stdout).get("workloadState") or {}
        except json.JSONDecodeError:
            return {}

    def listening(self, name: str) -> set[int]:
        out = self.pods[name].run("ss", "-Hltn").stdout
        return {int(line.split()[3].rpartition(":")[2]) for line in out.splitlines() if line.strip()}

    def captured(self, name: str) -> bool:
        return "ISTIO_PRERT" in self.pods[name].run("iptables-save").stdout

    def close(self) -> None:
        for process in (self.ztunnel, self.agent):
            self.stop(process)
        self.node.delete()


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    made = Mesh(tmp_path)
    try:
        yield made
    finally:
        made.close()


def up(mesh: Mesh, uid: str) -> bool:
    return (mesh.workload_state().get(uid) or {}).get("state") == "Up"


def plugin(command: str, pod: str, netns: str, stdin: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CNI_COMMAND": command, "CNI_CONTAINERID": "c0ffee", "CNI_NETNS": netns, "CNI_IFNAME": "eth0",
           "CNI_PATH": "/opt/cni/bin", "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME={pod}"}
    return subprocess.run([str(Path(sys.executable).parent / "istio-cni")], input=json.dumps(stdin), env=env,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_agent_captures_ambient_pods_for_the_real_ztunnel(mesh: Mesh) -> None:
    binary = ztunnel_binary()
    mesh.add_pod("a", 2)
    mesh.add_pod("b", 3)
    mesh.add_pod("c", 4)
    mesh.write("a", pod_yaml("a", mesh.node.pod_ip(2), "uid-a"))
    mesh.write("b", pod_yaml("b", mesh.node.pod_ip(3), "uid-b", mode="none"))
    # c and d have no IP yet: only the CNI plugin can name their network namespaces.
    mesh.write("c", pod_yaml("c", "", "uid-c"))
    mesh.write("d", pod_yaml("d", "", "uid-d"))
    agent = mesh.start_agent()
    ztunnel = mesh.start_ztunnel(binary)

    # Hello, snapshot: a is captured and handed over; b opted out; c waits for its plugin call.
    wait_until(lambda: up(mesh, "uid-a"), 30, "ztunnel to run pod a's proxy")
    wait_until(lambda: INPOD_PORTS <= mesh.listening("a"), 10, "ztunnel's listeners inside pod a")
    assert mesh.captured("a") and not mesh.captured("b") and not mesh.captured("c")
    assert set(mesh.workload_state()) == {"uid-a"}
    info = mesh.workload_state()["uid-a"]["info"]
    assert info == {"name": "a", "namespace": "demo", "serviceAccount": "sa-a"}, info

    # The agent chained the plugin into the node's CNI config and wrote the plugin executable.
    conflist = json.loads((mesh.conf_dir / "10-bridge.conflist").read_text())
    assert [p["type"] for p in conflist["plugins"]] == ["bridge", "istio-cni"]
    assert conflist["plugins"][1]["cni_agent_run_dir"] == str(mesh.run_dir)
    assert os.access(mesh.bin_dir / "istio-cni", os.X_OK)

    # The runtime's ADD for c: the previous result comes back, and c is captured before it returns.
    prev = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0"}],
            "ips": [{"address": f"{mesh.node.pod_ip(4)}/16", "interface": 0}]}
    entry = {**conflist["plugins"][1], "cniVersion": "1.0.0", "name": "k8s-pod-network", "prevResult": prev}
    netns_c = f"/var/run/netns/{mesh.pods['c'].name}"
    done = plugin("ADD", "c", netns_c, entry)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout) == prev
    assert mesh.captured("c") and up(mesh, "uid-c")
    wait_until(lambda: INPOD_PORTS <= mesh.listening("c"), 10, "ztunnel's listeners inside pod c")
    assert plugin("CHECK", "c", netns_c, entry).returncode == 0

    # An ADD naming a network namespace that vanished: a CNI error naming it, nothing else hurt.
    gone = plugin("ADD", "d", "/var/run/netns/sp-no-such-pod", entry)
    assert gone.returncode == 1
    error = json.loads(gone.stdout)
    assert error["code"] == 999 and "sp-no-such-pod" in error["msg"] and "demo/d" in error["msg"], error
    assert up(mesh, "uid-a") and up(mesh, "uid-c") and mesh.captured("c")

    # DEL through the plugin: c is released (rules gone, ztunnel dropped it) and stays released.
    done = plugin("DEL", "c", netns_c, {k: v for k, v in entry.items() if k != "prevResult"})
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr
    assert not mesh.captured("c")
    wait_until(lambda: "uid-c" not in mesh.workload_state(), 10, "ztunnel to drop pod c")
    wait_until(lambda: not INPOD_PORTS & mesh.listening("c"), 10, "pod c's listeners closed")
    assert "pod demo/c released: deleted through the CNI plugin" in agent.text()

    # A captured pod whose network namespace vanishes: released, ztunnel told, the others untouched.
    mesh.add_pod("e", 5)
    mesh.write("e", pod_yaml("e", mesh.node.pod_ip(5), "uid-e"))
    wait_until(lambda: up(mesh, "uid-e"), 15, "pod e with ztunnel")
    mesh.pods["e"].delete()
    wait_until(lambda: "uid-e" not in mesh.workload_state(), 15, "ztunnel to drop pod e")
    assert "pod demo/e released: its network namespace" in agent.text()
    assert up(mesh, "uid-a") and mesh.captured("a")

    # Opting out: a's rules are removed and ztunnel told; opting in again captures it again.
    mesh.write("a", pod_yaml("a", mesh.node.pod_ip(2), "uid-a", mode="none"))
    wait_until(lambda: not mesh.captured("a") and "uid-a" not in mesh.workload_state(), 15, "pod a released")
    mesh.write("a", pod_yaml("a", mesh.node.pod_ip(2), "uid-a"))
    wait_until(lambda: mesh.captured("a") and up(mesh, "uid-a"), 15, "pod a captured again")

    # ztunnel restarts: the new one gets the snapshot and runs a's proxy again.
    mesh.stop(ztunnel)
    ztunnel = mesh.start_ztunnel(binary)
    wait_until(lambda: up(mesh, "uid-a"), 30, "the new ztunnel to run pod a's proxy")
    wait_until(lambda: INPOD_PORTS <= mesh.listening("a"), 10, "the new ztunnel's listeners inside pod a")
    assert set(mesh.workload_state()) == {"uid-a"}

    # The agent restarts while b joins the mesh and a leaves it: the new agent's snapshot makes
    # ztunnel drop a and take b, and a's rules, left by the old agent, are removed.
    mesh.stop(agent)
    mesh.write("a", pod_yaml("a", mesh.node.pod_ip(2), "uid-a", mode="none"))
    mesh.write("b", pod_yaml("b", mesh.node.pod_ip(3), "uid-b"))
    assert mesh.captured("a")
    mesh.start_agent()
    wait_until(lambda: set(mesh.workload_state()) == {"uid-b"}, 30, "ztunnel to hold only pod b")
    assert "pod demo/a: removed redirection left from before" in mesh.agent.text()  # type: ignore[union-attr]
    assert mesh.captured("b") and not mesh.captured("a")
    wait_until(lambda: INPOD_PORTS <= mesh.listening("b") and not INPOD_PORTS & mesh.listening("a"), 10,
               "listeners in b only")

    # Uninstall on shutdown: the plugin is taken out of the CNI config.
    mesh.stop(mesh.agent)
    conflist = json.loads((mesh.conf_dir / "10-bridge.conflist").read_text())
    assert [p["type"] for p in conflist["plugins"]] == ["bridge"]

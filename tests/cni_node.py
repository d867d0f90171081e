"""A node for istio-cni tests: pods as network namespaces on a node namespace, the real ztunnel in
it (shared, in-pod mode), `istiod cni` and the `istio-cni` plugin run as a runtime runs it. What
ztunnel has is read from its admin `/config_dump` (`workloadState`) and from the listeners it opens
inside each pod; the capture from the pod's iptables. Everything is removed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from istiod.cni.membership import REDIRECTION_ENABLED
from istiod.demo.pods import NETNS_ETC, Netns, Node
from istiod.model.workload import AMBIENT_REDIRECTION_ANNOTATION
from tests.peers import ROOT, Process, wait_until
from tests.ztunnel_peer import ztunnel_binary

NODE = "node-1"
INPOD_PORTS = {15001, 15006, 15008}


def pod_yaml(name: str, ip: str, uid: str, mode: str | None = None, node: str = NODE,
             annotated: bool = False) -> dict[str, Any]:
    """`annotated`: marked as istio-cni marks a captured pod, which nothing writes in a config dir, and
    which is what makes istiod describe it as an HBONE workload."""
    labels = {"app": name} | ({"istio.io/dataplane-mode": mode} if mode else {})
    annotations = {AMBIENT_REDIRECTION_ANNOTATION: REDIRECTION_ENABLED} if annotated else {}
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "demo", "uid": uid, "labels": labels, "annotations": annotations},
        "spec": {"nodeName": node, "serviceAccountName": "sa-" + name, "containers": [{"name": "app", "image": "x"}]},
        "status": {"phase": "Running"},
    }
    if ip:  # running with an address: ready, so istiod counts it as a healthy endpoint
        pod["status"] |= {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
    return pod


class CniNode:
    """The config dir, the node and its pods, the agent, and ztunnel; all removed at the end."""

    def __init__(self, tmp: Path, name: str = NODE, subnet: str = "10.61", config: Path | None = None) -> None:
        """`config`: a config dir shared with other nodes (the cluster they all read)."""
        self.name = name
        self.tmp = tmp / name
        tmp = self.tmp
        tmp.mkdir()
        self.config = config or tmp / "config"
        self.config.mkdir(exist_ok=True)
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
        self.node = Node(subnet, name)
        self.pods: dict[str, Netns] = {}
        self.agent: Process | None = None
        self.ztunnel: Process | None = None
        self.apps: list[Process] = []

    def write(self, name: str, body: dict[str, Any]) -> None:
        staged = self.config / f".{name}.{self.name}.tmp"
        staged.write_text(json.dumps(body))
        staged.rename(self.config / f"{name}.yaml")

    def add_pod(self, name: str, host: int, nameserver: str = "") -> Netns:
        """`nameserver`: the pod's resolv.conf names it, searching the pod's namespace as in Kubernetes."""
        pod = self.pods[name] = self.node.add_pod(name, host)
        if nameserver:
            (NETNS_ETC / pod.name).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / pod.name / "resolv.conf").write_text(
                f"nameserver {nameserver}\nsearch demo.svc.cluster.local svc.cluster.local cluster.local\n")
        # Only this test's namespaces are searched by IP: never another test's pod of the same IP.
        (self.netns_dir / name).symlink_to(f"/var/run/netns/{pod.name}")
        return pod

    def start_agent(self, *source: str) -> Process:
        """`source`: where pods come from (default the config dir)."""
        source = source or ("--config-dir", str(self.config))
        self.agent = Process([sys.executable, "-m", "istiod", "cni", "--node-name", self.name, *source,
                              "--ztunnel-uds-address", str(self.socket),
                              "--cni-agent-run-dir", str(self.run_dir), "--mounted-cni-net-dir", str(self.conf_dir),
                              "--cni-bin-dir", str(self.bin_dir), "--netns-dir", str(self.netns_dir),
                              "--resync", "500ms", "--zds-ack-timeout", "5s"], name="istiod cni")
        wait_until(lambda: "ready" in self.agent.text() or self.agent.proc.poll() is not None, 30, "the agent ready")  # type: ignore[union-attr]
        assert self.agent.proc.poll() is None, self.agent.log()
        return self.agent

    def start_ztunnel(self, binary: str, local: Path | None = None, xds: dict[str, str] | None = None) -> Process:
        """`local`: ztunnel's static config; `xds`: the variables pointing it at istiod instead."""
        workdir = self.tmp / "ztunnel"
        workdir.mkdir(exist_ok=True)
        env = {"INPOD_UDS": str(self.socket), "FAKE_CA": "true", "NODE_NAME": self.name, "POD_NAME": f"ztunnel-{self.name}",
               "POD_NAMESPACE": "istio-system", "RUST_LOG": "info",
               # Without an xDS server ztunnel connects to ZDS at once; with one, once its first
               # xDS state arrived.
               "XDS_ADDRESS": ""}
        if local is not None:
            env["LOCAL_XDS_PATH"] = str(local)
        env.update(xds or {})
        # From an empty working directory: ztunnel reads ./var/run/secrets/... by default.
        self.ztunnel = Process(self.node.ns.exec_args("env", "-C", str(workdir), binary), env=env, name="ztunnel")
        return self.ztunnel

    def stop(self, process: Process | None) -> None:
        if process is not None:
            process.stop()

    def config_dump(self) -> dict[str, Any]:
        """ztunnel's admin /config_dump; ValueError while it does not answer."""
        done = self.node.ns.run("curl", "-s", "--max-time", "5", "http://127.0.0.1:15000/config_dump")
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    def workload_state(self) -> dict[str, Any]:
        """The pods ztunnel took over ZDS, by UID."""
        try:
            return self.config_dump().get("workloadState") or {}
        except ValueError:
            return {}

    def listening(self, name: str) -> set[int]:
        out = self.pods[name].run("ss", "-Hltn").stdout
        return {int(line.split()[3].rpartition(":")[2]) for line in out.splitlines() if line.strip()}

    def captured(self, name: str) -> bool:
        return "ISTIO_PRERT" in self.pods[name].run("iptables-save").stdout

    def start_echo(self, name: str, port: int) -> None:
        """An HTTP app in the pod on every address: ztunnel delivers inbound traffic over loopback."""
        self.apps.append(Process(self.pods[name].exec_args(sys.executable, "tests/http_echo.py", "0.0.0.0", str(port)),
                                 name=f"echo in {name}"))

    def call(self, source: str, target: str, port: int) -> str:
        done = self.pods[source].run("curl", "-s", "--max-time", "5", f"http://{target}:{port}/")
        return done.stdout

    def local_config(self, *pods: tuple[CniNode, str, int]) -> Path:
        """ztunnel's own static config (LOCAL_XDS_PATH): each pod an HBONE workload on its node, as
        istiod's WDS would describe it."""
        path = self.tmp / "ztunnel-local.yaml"
        workloads = [{"uid": f"Kubernetes//Pod/demo/{name}", "name": name, "namespace": "demo",
                      "serviceAccount": f"sa-{name}", "workloadIps": [node.node.pod_ip(host)], "protocol": "HBONE",
                      "node": node.name, "network": "", "services": {}} for node, name, host in pods]
        path.write_text(json.dumps({"workloads": workloads}))
        return path

    def link(self, other: CniNode) -> None:
        """A veth between the two node namespaces, each routing the other's pod subnet over it."""
        for args in (["link", "add", "peer0", "netns", self.node.ns.name, "type", "veth", "peer", "name", "peer0",
                      "netns", other.node.ns.name],
                     ["-n", self.node.ns.name, "addr", "add", "192.168.255.1/30", "dev", "peer0"],
                     ["-n", other.node.ns.name, "addr", "add", "192.168.255.2/30", "dev", "peer0"],
                     ["-n", self.node.ns.name, "link", "set", "peer0", "up"],
                     ["-n", other.node.ns.name, "link", "set", "peer0", "up"],
                     ["-n", self.node.ns.name, "route", "add", f"{other.node.subnet}.0.0/16", "via", "192.168.255.2"],
                     ["-n", other.node.ns.name, "route", "add", f"{self.node.subnet}.0.0/16", "via", "192.168.255.1"]):
            subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def close(self) -> None:
        for process in (*self.apps, self.ztunnel, self.agent):
            self.stop(process)
        self.node.delete()


@contextlib.contextmanager
def two_nodes(tmp: Path) -> Iterator[tuple[CniNode, CniNode]]:
    """node-1 and node-2 reading one config dir (the cluster), linked so their pods reach each other."""
    nodes: list[CniNode] = []
    try:
        nodes.append(CniNode(tmp, "node-1", "10.61", tmp / "cluster"))
        nodes.append(CniNode(tmp, "node-2", "10.62", tmp / "cluster"))
        nodes[0].link(nodes[1])
        yield nodes[0], nodes[1]
    finally:
        for node in reversed(nodes):
            node.close()


@pytest.fixture
def cni_node(tmp_path: Path) -> Iterator[CniNode]:
    made = CniNode(tmp_path)
    try:
        yield made
    finally:
        made.close()


def up(mesh: CniNode, uid: str) -> bool:
    return (mesh.workload_state().get(uid) or {}).get("state") == "Up"


def plugin(command: str, pod: str, netns: str, stdin: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CNI_COMMAND": command, "CNI_CONTAINERID": "c0ffee", "CNI_NETNS": netns, "CNI_IFNAME": "eth0",
           "CNI_PATH": "/opt/cni/bin", "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME={pod}"}
    return subprocess.run([str(Path(sys.executable).parent / "istio-cni")], input=json.dumps(stdin), env=env,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)



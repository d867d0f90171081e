"""`istiod cni` with the real ztunnel in shared (in-pod) mode (see tests/cni_node.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.cni_node import INPOD_PORTS, CniNode, cni_node, plugin, pod_yaml, two_nodes, up  # noqa: F401
from tests.ztunnel_peer import ztunnel_binary
from tests.peers import Process, wait_until
from tests.pods import requires_root

pytestmark = requires_root


def test_agent_captures_ambient_pods_for_the_real_ztunnel(cni_node: CniNode) -> None:
    mesh, binary = cni_node, ztunnel_binary()
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


def test_traffic_between_captured_pods_goes_over_hbone_and_resumes_after_a_ztunnel_restart(cni_node: CniNode) -> None:
    """What istiod's WDS will say (both pods HBONE workloads of this node) comes from ztunnel's own
    static config here: the point is that the agent's rules bring each pod's traffic to ztunnel."""
    mesh, binary = cni_node, ztunnel_binary()
    for name, host in (("a", 2), ("b", 3)):
        mesh.add_pod(name, host)
        mesh.write(name, pod_yaml(name, mesh.node.pod_ip(host), f"uid-{name}"))
        mesh.start_echo(name, 8080)
    local = mesh.local_config((mesh, "a", 2), (mesh, "b", 3))
    mesh.start_agent()
    ztunnel = mesh.start_ztunnel(binary, local)
    a, b = mesh.node.pod_ip(2), mesh.node.pod_ip(3)

    def hbone(source: Process, client: str, server: str) -> bool:
        """ztunnel logged both ends of a completed HBONE connection from `client` to `server`'s app."""
        lines = [l for l in source.output if "connection complete" in l and f"dst.hbone_addr={server}:8080" in l
                 and f"src.addr={client}:" in l and "error=" not in l]
        return {'direction="outbound"', 'direction="inbound"'} <= {d for l in lines for d in l.split() if "direction" in d}

    wait_until(lambda: up(mesh, "uid-a") and up(mesh, "uid-b"), 30, "ztunnel to run both pods' proxies")
    assert json.loads(mesh.call("a", b, 8080))["host"] == f"{b}:8080"
    assert json.loads(mesh.call("b", a, 8080))["host"] == f"{a}:8080"
    wait_until(lambda: hbone(ztunnel, a, b) and hbone(ztunnel, b, a), 5, "ztunnel's access log of both calls")

    mesh.stop(ztunnel)
    assert mesh.call("a", b, 8080) == ""  # captured and no ztunnel: nothing gets out (fail closed)
    ztunnel = mesh.start_ztunnel(binary, local)
    wait_until(lambda: up(mesh, "uid-a") and up(mesh, "uid-b"), 30, "the new ztunnel to take the snapshot")
    wait_until(lambda: mesh.call("a", b, 8080), 10, "a's call to b to work again")
    wait_until(lambda: hbone(ztunnel, a, b), 5, "the new ztunnel's access log of the call")


def test_two_nodes_each_with_its_agent_and_ztunnel(tmp_path: Path) -> None:
    """Pods on two nodes, each node with its own ztunnel and agent reading the same config dir: each
    agent captures only its node's pods, and a call crosses from one node's ztunnel to the other's
    over HBONE; a pod deleted through the plugin on one node is released there only."""
    binary = ztunnel_binary()
    with two_nodes(tmp_path) as (one, two):
        nodes = (one, two)
        for node, name in ((one, "a"), (two, "b")):
            node.add_pod(name, 2)
            node.write(name, pod_yaml(name, node.node.pod_ip(2), f"uid-{name}", node=node.name))
            node.start_echo(name, 8080)
        local = one.local_config((one, "a", 2), (two, "b", 2))
        ztunnels = {}
        for node in nodes:
            node.start_agent()
            ztunnels[node.name] = node.start_ztunnel(binary, local)
        wait_until(lambda: up(one, "uid-a") and up(two, "uid-b"), 30, "each ztunnel to run its node's pod")
        assert set(one.workload_state()) == {"uid-a"} and set(two.workload_state()) == {"uid-b"}
        a, b = one.node.pod_ip(2), two.node.pod_ip(2)
        assert json.loads(one.call("a", b, 8080))["host"] == f"{b}:8080"
        assert json.loads(two.call("b", a, 8080))["host"] == f"{a}:8080"

        def logged(node: str, direction: str, client: str, server: str) -> bool:
            return any("connection complete" in l and f'direction="{direction}"' in l and f"src.addr={client}:" in l
                       and f"dst.hbone_addr={server}:8080" in l and "error=" not in l for l in ztunnels[node].output)

        wait_until(lambda: logged("node-1", "outbound", a, b) and logged("node-2", "inbound", a, b), 5,
                   "a's call leaving through node-1's ztunnel and arriving through node-2's")

        # DEL through the plugin on node-2: b is released there, a on node-1 is untouched.
        entry = {"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "istio-cni",
                 "cni_agent_run_dir": str(two.run_dir)}
        done = plugin("DEL", "b", f"/var/run/netns/{two.pods['b'].name}", entry)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_until(lambda: "uid-b" not in two.workload_state(), 10, "node-2's ztunnel to drop b")
        assert not two.captured("b") and one.captured("a") and up(one, "uid-a")

"""Ambient end to end: real traffic between pods on two nodes, each node with its own real ztunnel
(shared, in-pod mode) and `istiod cni` agent, istiod the xDS server and CA of both ztunnels (no
FAKE_CA: each ztunnel's token is bound to its pod, so it gets certificates only for its node's
workloads). The cluster is a config dir: pods carry `ambient.istio.io/redirection: enabled` there,
since no agent can write it.

A in node-1 calls B's Service by name: ztunnel's DNS proxy (the agent captures the pod's DNS)
answers with the VIP from WDS, and the call crosses both ztunnels over HBONE with mTLS; node-2's
ztunnel names A's SPIFFE identity. An L4 DENY on A's principal blocks the call, removing it restores
the call (each measured); node-1's ztunnel restarting gets the snapshot again and traffic resumes; B
deleted through the plugin is released.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.cni_node import INPOD_PORTS, CniNode, plugin, pod_yaml, up
from tests.peers import Process, wait_until
from tests.pods import requires_root
from tests.ztunnel_peer import istiod_for_ztunnels, node_tokens, shared_env, ztunnel_binary, ztunnel_pod

pytestmark = requires_root
VIP = "10.96.0.20"  # B's Service
NAMESERVER = "10.96.0.10"  # the pods' resolver: only ztunnel answers (their DNS is captured)
ISTIOD = "192.168.255.1:15012"  # node-1's end of the link between the nodes (CniNode.link)
A_IDENTITY = "spiffe://cluster.local/ns/demo/sa/sa-a"
DENY_A = {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
          "metadata": {"name": "deny-a", "namespace": "demo"},
          "spec": {"selector": {"matchLabels": {"app": "b"}}, "action": "DENY",
                   "rules": [{"from": [{"source": {"principals": ["cluster.local/ns/demo/sa/sa-a"]}}]}]}}


def answer(node: CniNode) -> dict[str, Any] | None:
    """A's call to B's Service by its short name (resolved through the pod's search domains)."""
    body = node.call("a", "b", 80)
    return json.loads(body) if body else None


def timed(check: Callable[[], Any], what: str, timeout: float = 5) -> float:
    """Seconds until `check` holds (asserted within `timeout`), printed."""
    started = time.monotonic()
    wait_until(check, timeout, what, interval=0.02)
    took = time.monotonic() - started
    print(f"{what}: after {took:.3f}s")
    return took


def inbound_from_a(ztunnel: Process) -> list[str]:
    """ztunnel's access log lines of completed inbound connections from A's identity."""
    return [line for line in ztunnel.output if "connection complete" in line and 'direction="inbound"' in line
            and f'src.identity="{A_IDENTITY}"' in line and "error=" not in line]


def opened_from_a(node: CniNode) -> float:
    """istio_tcp_connections_opened_total with A's principal as source, on the node's ztunnel."""
    metrics = node.node.ns.run("curl", "-s", "--max-time", "5", "http://127.0.0.1:15020/metrics").stdout
    pattern = re.compile(r'^istio_tcp_connections_opened_total\{([^}]*)\} (\S+)$', re.M)
    return sum(float(value) for labels, value in pattern.findall(metrics)
               if f'source_principal="{A_IDENTITY}"' in labels and 'reporter="destination"' in labels)


def test_pods_on_two_nodes_call_by_name_over_hbone_with_policy_restart_and_release(tmp_path: Path) -> None:
    binary = ztunnel_binary()
    config = tmp_path / "cluster"
    nodes: list[CniNode] = []
    istiod: Process | None = None
    try:
        one = CniNode(tmp_path, "node-1", "10.61", config)
        nodes.append(one)
        two = CniNode(tmp_path, "node-2", "10.62", config)
        nodes.append(two)
        one.link(two)
        tokens = {f"zt-{node.name}": f"ztunnel-{node.name}" for node in nodes}
        for node in nodes:
            node.write(f"node-{node.name}", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name}})
            node.write(f"ztunnel-{node.name}", ztunnel_pod(f"ztunnel-{node.name}", node.name))
        one.write("service-b", {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "b", "namespace": "demo"},
                                "spec": {"clusterIP": VIP, "selector": {"app": "b"},
                                         "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})
        for node, name in ((one, "a"), (two, "b")):
            node.add_pod(name, 2, nameserver=NAMESERVER)
            node.write(name, pod_yaml(name, node.node.pod_ip(2), f"uid-{name}", node=node.name, annotated=True))
        two.start_echo("b", 8080)  # the only app: any answer is B's
        istiod = istiod_for_ztunnels(one.node.ns, config, tmp_path / "state", node_tokens(tmp_path / "tokens.json", tokens),
                                     "--debounce-after", "20ms", secure=ISTIOD)
        envs = {node.name: shared_env(tmp_path / "state", ISTIOD, f"zt-{node.name}", f"ztunnel-{node.name}", node.name)
                for node in nodes}
        ztunnels = {}
        for node in nodes:
            node.start_agent()
            ztunnels[node.name] = node.start_ztunnel(binary, xds=envs[node.name])
        try:
            wait_until(lambda: up(one, "uid-a") and up(two, "uid-b"), 60, "each ztunnel to run its node's pod")
            timed(lambda: answer(one), "A's first call to b (by name) answered", 30)
        except AssertionError:
            raise AssertionError("\n".join(f"{p.name}:\n{p.log()[-3000:]}" for p in
                                           (istiod, *ztunnels.values(), one.agent, two.agent) if p)) from None
        assert answer(one) == {"host": "b", "xfcc": None}

        # The certificate each ztunnel holds came from our CA, for its own node's workload only.
        held = {node.name: {c["identity"] for c in node.config_dump().get("certificates", [])} for node in nodes}
        assert A_IDENTITY in held["node-1"] and A_IDENTITY not in held["node-2"], held
        assert "issued a certificate for spiffe://cluster.local/ns/demo/sa/sa-b (by StaticTokenAuthenticator, " \
               "on behalf of node account istio-system/ztunnel)" in istiod.text()

        # Over HBONE through both ztunnels, B's side naming A's identity (log and metrics).
        a, b = one.node.pod_ip(2), two.node.pod_ip(2)

        def crossed() -> bool:
            out = [l for l in ztunnels["node-1"].output if "connection complete" in l and 'direction="outbound"' in l
                   and f"dst.hbone_addr={b}:8080" in l and f"src.addr={a}:" in l and "error=" not in l]
            into = [l for l in inbound_from_a(ztunnels["node-2"]) if f"dst.hbone_addr={b}:8080" in l]
            return bool(out and into)

        wait_until(crossed, 5, "the call leaving through node-1's ztunnel and arriving through node-2's")
        print(next(l for l in inbound_from_a(ztunnels["node-2"])).strip())
        assert opened_from_a(two) >= 1

        # An L4 DENY on A's principal: A's calls fail; removed, they work again.
        one.write("deny-a", DENY_A)
        timed(lambda: answer(one) is None, "the DENY blocking A's call")
        denied = [l for l in ztunnels["node-2"].output if 'direction="inbound"' in l
                  and "policy rejection: explicitly denied by: demo/deny-a" in l and f'src.identity="{A_IDENTITY}"' in l]
        assert denied, ztunnels["node-2"].log()
        print(denied[0].strip())
        (config / "deny-a.yaml").unlink()
        timed(lambda: answer(one), "the DENY removed, A's call answered")

        # node-1's ztunnel restarts: the new one gets the agent's snapshot and A's traffic resumes.
        one.stop(ztunnels["node-1"])
        assert answer(one) is None  # captured and no ztunnel: nothing leaves A
        ztunnels["node-1"] = one.start_ztunnel(binary, xds=envs["node-1"])
        timed(lambda: answer(one), "after node-1's ztunnel restarted, A's call answered", 30)

        # B deleted through the plugin on node-2: released (its rules gone, ztunnel dropped it).
        entry = {"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "istio-cni",
                 "cni_agent_run_dir": str(two.run_dir)}
        done = plugin("DEL", "b", f"/var/run/netns/{two.pods['b'].name}", entry)
        assert done.returncode == 0, done.stdout + done.stderr
        assert not two.captured("b")
        wait_until(lambda: "uid-b" not in two.workload_state(), 10, "node-2's ztunnel to drop b")
        wait_until(lambda: not INPOD_PORTS & two.listening("b"), 10, "b's in-pod listeners closed")
        assert "pod demo/b released: deleted through the CNI plugin" in two.agent.text()  # type: ignore[union-attr]
        assert up(one, "uid-a") and one.captured("a")
    finally:
        if istiod is not None:
            istiod.stop()
        for node in reversed(nodes):
            node.close()

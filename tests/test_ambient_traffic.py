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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cni_node import INPOD_PORTS, CniNode, plugin, pod_yaml, two_nodes, up
from tests.peers import Process, wait_until
from tests.pods import requires_root
from tests.ztunnel_peer import istiod_for_ztunnels, node_tokens, shared_env, ztunnel_binary, ztunnel_pod

pytestmark = requires_root
VIP = "10.96.0.20"  # B's Service
NAMESERVER = "10.96.0.10"  # the pods' resolver: only ztunnel answers (their DNS is captured)
ISTIOD = "192.168.255.1:15012"  # node-1's end of the link between the nodes (CniNode.link)
A_IDENTITY = "spiffe://cluster.local/ns/demo/sa/sa-a"
DENY_A: dict[str, Any] = {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
          "metadata": {"name": "deny-a", "namespace": "demo"},
          "spec": {"selector": {"matchLabels": {"app": "b"}}, "action": "DENY",
                   "rules": [{"from": [{"source": {"principals": ["cluster.local/ns/demo/sa/sa-a"]}}]}]}}


def answer(node: CniNode) -> dict[str, Any] | None:
    """A's call to B's Service by its short name (resolved through the pod's search domains)."""
    body = node.call("a", "b", 80)
    return json.loads(body) if body else None


def timed(check: Callable[[], Any], what: str, timeout: float = 5) -> None:
    """Waits until `check` holds (asserted within `timeout`) and prints how long that took."""
    started = time.monotonic()
    wait_until(check, timeout, what, interval=0.02)
    print(f"{what}: after {time.monotonic() - started:.3f}s")


def inbound_from_a(ztunnel: Process) -> list[str]:
    """ztunnel's access log lines of completed inbound connections from A's identity."""
    return [line for line in ztunnel.output if "connection complete" in line and 'direction="inbound"' in line
            and f'src.identity="{A_IDENTITY}"' in line and "error=" not in line]


def ztunnel_metric(node: CniNode, name: str, *labels: str) -> float:
    """The sum of the samples of `name` whose labels include each of `labels`, from the node's ztunnel."""
    metrics = node.node.ns.run("curl", "-s", "--max-time", "5", "http://127.0.0.1:15020/metrics").stdout
    samples = re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", metrics, re.M)
    return sum(float(value) for found, value in samples if all(label in found for label in labels))


@dataclass(frozen=True)
class Cluster:
    one: CniNode  # node-1: pod A, and istiod
    two: CniNode  # node-2: pod B, B's Service's only endpoint
    istiod: Process
    binary: str
    state: Path  # istiod's CA state: its root certificate
    ztunnels: dict[str, Process]  # by node, as (re)started

    def start_ztunnel(self, node: CniNode) -> None:
        """The node's ztunnel, shared mode, on istiod's xDS and CA with its pod-bound token."""
        env = shared_env(self.state, ISTIOD, f"zt-{node.name}", f"ztunnel-{node.name}", node.name)
        self.ztunnels[node.name] = node.start_ztunnel(self.binary, xds=env)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with ambient_cluster(tmp_path) as made:
        yield made


@contextmanager
def ambient_cluster(tmp_path: Path, tokens: Mapping[str, str] | None = None) -> Iterator[Cluster]:
    """Two nodes, each with its ztunnel pod, agent and ztunnel; A on node-1, B and its Service on node-2;
    istiod in node-1's namespace, on the link's address so node-2's ztunnel reaches it too. `tokens`:
    more of istiod's static tokens (token -> `namespace/serviceaccount`)."""
    with two_nodes(tmp_path) as (one, two):
        for node in (one, two):
            node.write(f"node-{node.name}", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name}})
            node.write(f"ztunnel-{node.name}", ztunnel_pod(f"ztunnel-{node.name}", node.name))
        one.write("service-b", {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "b", "namespace": "demo"},
                                "spec": {"clusterIP": VIP, "selector": {"app": "b"},
                                         "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})
        for node, name in ((one, "a"), (two, "b")):
            node.add_pod(name, 2, nameserver=NAMESERVER)
            node.write(name, pod_yaml(name, node.node.pod_ip(2), f"uid-{name}", node=node.name, annotated=True))
        two.start_echo("b", 8080)  # the only app: any answer is B's
        written = node_tokens(tmp_path / "tokens.json", {f"zt-{node.name}": f"ztunnel-{node.name}" for node in (one, two)})
        written.write_text(json.dumps({**json.loads(written.read_text()), **(tokens or {})}))
        istiod = istiod_for_ztunnels(one.node.ns, one.config, tmp_path / "state", written, "--debounce-after", "20ms",
                                     secure=ISTIOD)
        try:
            made = Cluster(one, two, istiod, ztunnel_binary(), tmp_path / "state", {})
            for node in (one, two):
                node.start_agent()
                made.start_ztunnel(node)
            try:
                wait_until(lambda: up(one, "uid-a") and up(two, "uid-b"), 60, "each ztunnel to run its node's pod")
                timed(lambda: answer(one), "A's first call to b (by name) answered", 30)
            except AssertionError:
                raise AssertionError("\n".join(f"{p.name}:\n{p.log()[-3000:]}" for p in
                                               (istiod, *made.ztunnels.values(), one.agent, two.agent) if p)) from None
            yield made
        finally:
            istiod.stop()


def test_pods_on_two_nodes_call_by_name_over_hbone_with_policy_restart_and_release(cluster: Cluster) -> None:
    one, two, istiod, ztunnels = cluster.one, cluster.two, cluster.istiod, cluster.ztunnels
    reply = answer(one)
    assert reply is not None and (reply["host"], reply["xfcc"]) == ("b", None)

    # The certificate each ztunnel holds came from our CA, for its own node's workload only.
    held = {node.name: {c["identity"] for c in node.config_dump().get("certificates", [])} for node in (one, two)}
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
    assert ztunnel_metric(two, "istio_tcp_connections_opened_total", 'reporter="destination"',
                          f'source_principal="{A_IDENTITY}"') >= 1
    assert ztunnel_metric(one, "istio_dns_requests_total") >= 1  # "b" resolved by node-1's ztunnel

    # An L4 DENY on A's principal: A's calls fail; removed, they work again.
    one.write("deny-a", DENY_A)
    timed(lambda: answer(one) is None, "the DENY blocking A's call")
    # The call under way when the policy arrived may have been closed as "no longer allowed"; a new
    # one is refused at B's ztunnel by name of the policy.
    assert answer(one) is None

    def denied() -> list[str]:
        return [l for l in ztunnels["node-2"].output if 'direction="inbound"' in l
                and "policy rejection: explicitly denied by: demo/deny-a" in l and f'src.identity="{A_IDENTITY}"' in l]

    try:
        wait_until(denied, 5, "node-2's ztunnel logging the DENY of A's call")
    except AssertionError:
        raise AssertionError(ztunnels["node-2"].log()[-3000:]) from None
    print(denied()[0].strip())
    (one.config / "deny-a.yaml").unlink()
    timed(lambda: answer(one), "the DENY removed, A's call answered")

    # A policy istiod cannot take (an action that does not exist): refused with a line naming it, and
    # ztunnel keeps the last good policies, so A's calls still work.
    one.write("bad", DENY_A | {"metadata": {"name": "bad", "namespace": "demo"},
                               "spec": DENY_A["spec"] | {"action": "BLOCK"}})
    wait_until(lambda: "demo/bad" in istiod.text(), 5, "istiod refusing demo/bad")
    print(next(line for line in istiod.output if "demo/bad" in line).strip())
    assert answer(one)

    # node-1's ztunnel restarts: the new one gets the agent's snapshot and A's traffic resumes.
    one.stop(ztunnels["node-1"])
    assert answer(one) is None  # captured and no ztunnel: nothing leaves A
    cluster.start_ztunnel(one)
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
    assert answer(one) is None  # nothing serves B's HBONE port any more

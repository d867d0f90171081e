"""The pod harness and `istiod agent iptables` with Envoys given a static config (no istiod):
traffic between two pod namespaces is captured on both sides and carried by both Envoys as uid 1337."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from istiod.demo.pods import ENVOY_UID, Netns, Node, sweep
from tests.envoy_peer import envoy_binary
from tests.peers import Process
from tests.pods import app, call, requires_root, shared_dir, stats, uids, wait_envoy_ready, wait_serving

pytestmark = requires_root

ORIGINAL_DST = {"name": "envoy.filters.listener.original_dst",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst"}}


def _passthrough(name: str, port: int, cluster: str) -> dict[str, object]:
    return {
        "name": name,
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}},
        "listener_filters": [ORIGINAL_DST],
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": cluster, "cluster": cluster}}]}],
    }


# The two passthrough paths of a sidecar, by hand: what istiod's sidecar config must at least do.
STATIC_SIDECAR = {
    "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
    "static_resources": {
        "listeners": [_passthrough("virtualOutbound", 15001, "PassthroughCluster"),
                      _passthrough("virtualInbound", 15006, "InboundPassthroughCluster")],
        "clusters": [
            {"name": "PassthroughCluster", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
             "connect_timeout": "2s"},
            {"name": "InboundPassthroughCluster", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
             "connect_timeout": "2s",
             "upstream_bind_config": {"source_address": {"address": "127.0.0.6", "port_value": 0}}},
        ],
    },
}


@dataclass
class StaticPods:
    node: Node
    a: Netns
    b: Netns
    envoys: dict[str, Process]
    server: Process
    b_ip: str


@pytest.fixture(scope="module")
def static_pods() -> Iterator[StaticPods]:
    envoy = envoy_binary()
    sweep()
    directory = shared_dir("sp-static-")
    config = directory / "envoy.json"
    config.write_text(json.dumps(STATIC_SIDECAR))
    node = Node(subnet="10.45")
    processes: list[Process] = []
    try:
        b_ip = node.pod_ip(3)
        a = node.add_pod("a", 2, hosts={"echo.sp.svc.cluster.local": b_ip})
        b = node.add_pod("b", 3)
        for pod in (a, b):
            capture = pod.run(sys.executable, "-m", "istiod", "agent", "iptables")
            assert capture.returncode == 0, capture.stderr
        server = app(b, "http-server", "--address", f"{b_ip}:8080", "--name", "b", name="b-app")
        processes.append(server)
        envoys = {}
        for name, pod in (("a", a), ("b", b)):
            envoys[name] = Process(pod.exec_args(envoy, "-c", str(config), "--disable-hot-restart",
                                                 "--log-level", "warn", uid=ENVOY_UID), name=f"envoy-{name}")
            processes.append(envoys[name])
        wait_serving(server)
        for name, pod in (("a", a), ("b", b)):
            wait_envoy_ready(pod, envoys[name])
        yield StaticPods(node, a, b, envoys, server, b_ip)
    finally:
        for process in reversed(processes):
            process.stop()
        node.delete()
        shutil.rmtree(directory, ignore_errors=True)


def test_http_between_pods_goes_through_both_envoys(static_pods: StaticPods) -> None:
    a, b = static_pods.a, static_pods.b
    reply = call(a, "http-get", "http://echo.sp.svc.cluster.local:8080/hello")
    print("A's app got:", reply)
    assert reply["ok"], reply
    # B's app is reached from 127.0.0.6: Envoy's inbound passthrough, not A directly.
    assert reply["body"]["name"] == "b" and reply["body"]["peer"] == "127.0.0.6"
    outbound = stats(a, "cluster.PassthroughCluster.upstream_cx_total")
    inbound = stats(b, "cluster.InboundPassthroughCluster.upstream_cx_total")
    print("A's Envoy:", outbound, "B's Envoy:", inbound)
    assert outbound["cluster.PassthroughCluster.upstream_cx_total"] >= 1
    assert inbound["cluster.InboundPassthroughCluster.upstream_cx_total"] >= 1


def test_envoys_run_as_1337_and_are_not_captured_themselves(static_pods: StaticPods) -> None:
    for process in static_pods.envoys.values():
        assert uids(process.proc.pid) == [str(ENVOY_UID)] * 4
    # 15021 (the agent's readiness) is not captured inbound: A's Envoy gets a refusal from B's
    # kernel, and B's Envoy never sees the connection.
    a, b = static_pods.a, static_pods.b
    inbound = "cluster.InboundPassthroughCluster.upstream_cx_total"
    before = stats(b, inbound)[inbound]
    reply = call(a, "tcp-call", f"{static_pods.b_ip}:15021", "ping", timeout=10)
    assert not reply["ok"], reply
    assert stats(a, "cluster.PassthroughCluster.upstream_cx_connect_fail")[
        "cluster.PassthroughCluster.upstream_cx_connect_fail"] >= 1
    assert stats(b, inbound)[inbound] == before

"""Locality load balancing through a real Envoy sidecar: web-1 (r1/zone-a, from its bootstrap) calls
Service echo, two pods in zone-a and two in zone-b (tests/data/locality-mesh.yaml). With outlier
detection only zone-a answers until its pods fail and are ejected, then zone-b does; `distribute`
splits by weight. curl in the pod is the client, as in test_envoy_routing.py. And a proxyless gRPC
client (grpcio) takes the same priorities.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import DATA, render
from tests.envoy_peer import Envoy, sidecar_envoy
from tests.peers import Istiod, Process, free_port, wait_until
from tests.test_envoy_sidecar import _acked, captured_pod
from tests.test_proxyless_grpc import SERVICE_PORT

ECHO_VIP = "10.96.0.20"
BACKENDS = {"echo-a1": "127.0.0.51", "echo-a2": "127.0.0.52", "echo-b1": "127.0.0.53", "echo-b2": "127.0.0.54"}
ZONE_A = {"echo-a1", "echo-a2"}
FAILOVER = """
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: echo, namespace: shop}
spec:
  host: echo.shop.svc.cluster.local
  trafficPolicy:
    outlierDetection: {consecutive5xxErrors: 2, interval: 1s, baseEjectionTime: 120s, maxEjectionPercent: 100}
"""
DISTRIBUTE = """
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: echo, namespace: shop}
spec:
  host: echo.shop.svc.cluster.local
  trafficPolicy:
    loadBalancer:
      localityLbSetting:
        distribute: [{from: "r1/zone-a/*", to: {"r1/zone-a/*": 70, "r1/zone-b/*": 30}}]
"""


@dataclass
class Pod:
    istiod: Istiod
    envoy: Envoy
    run: Callable[..., subprocess.CompletedProcess[str]]
    config: Path
    failing: Path  # a backend fails while a file of its name is here

    def calls(self, count: int) -> list[tuple[int, str]]:
        """`count` requests to echo over one curl (keep-alive): (status, backend name) each."""
        done = self.run("curl", "-s", "--max-time", "30", "-H", "Host: echo", "-w", " %{http_code}\n",
                        *[f"http://{ECHO_VIP}/"] * count)
        assert done.returncode == 0, done.stderr
        return [(int(code), (re.findall(r'"name": "([^"]*)"', body) or [""])[0])
                for body, code in (line.rsplit(" ", 1) for line in done.stdout.splitlines())]

    def apply(self, rule: str) -> None:
        (self.config / "rule.yaml").write_text(rule)


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (Debian's package) for the capture rules")
    workdir = tmp_path_factory.mktemp("locality-lb")
    config, failing = workdir / "mesh", workdir / "failing"
    config.mkdir()
    failing.mkdir()
    for name in ("sidecar-mesh.yaml", "locality-mesh.yaml"):
        shutil.copy(DATA / name, config / name)
    istiod = Istiod(workdir, "--config-dir", str(config), "--poll-interval", "100ms")
    try:
        with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web",
                           locality={"region": "r1", "zone": "zone-a"}) as envoy, \
                captured_pod(istiod, envoy) as run:
            assert run("ip", "addr", "add", f"{ECHO_VIP}/32", "dev", "lo").returncode == 0  # a route to the VIP
            backends = [Process(envoy.netns(sys.executable, "tests/http_echo.py", address, "8080", name,
                                            str(failing / name)), name=name)
                        for name, address in BACKENDS.items()]
            try:
                for address in BACKENDS.values():
                    wait_until(lambda: run("curl", "-s", f"http://{address}:8080/").returncode == 0, 10,
                               f"the backend on {address}")
                _acked(istiod, envoy)
                yield Pod(istiod, envoy, run, config, failing)
            finally:
                for backend in backends:
                    backend.stop()
    finally:
        istiod.stop()


def _priorities(envoy: Envoy) -> dict[str, int]:
    """Backend address -> EDS priority, as Envoy holds them."""
    result = {}
    for config in json.loads(envoy.get("/config_dump?include_eds")[1])["configs"]:
        for entry in config.get("dynamic_endpoint_configs", []):
            assignment = entry["endpoint_config"]
            if "echo.shop" not in assignment["cluster_name"]:
                continue
            for group in assignment.get("endpoints", []):
                for lb in group.get("lb_endpoints", []):
                    result[lb["endpoint"]["address"]["socket_address"]["address"]] = group.get("priority", 0)
    return result


def test_own_zone_first_then_failover_when_it_fails(pod: Pod) -> None:
    pod.apply(FAILOVER)
    expected = {BACKENDS["echo-a1"]: 0, BACKENDS["echo-a2"]: 0, BACKENDS["echo-b1"]: 1, BACKENDS["echo-b2"]: 1}
    wait_until(lambda: _priorities(pod.envoy) == expected, 20, f"zone-a at priority 0 in Envoy: {_priorities(pod.envoy)}")
    answered = pod.calls(40)
    assert {code for code, _ in answered} == {200}
    assert {name for _, name in answered} == ZONE_A  # both of zone-a, never zone-b

    for name in ZONE_A:
        (pod.failing / name).touch()
    try:
        # Each zone-a pod fails twice (consecutive5xxErrors: 2) before it is ejected; then zone-b answers.
        wait_until(lambda: all(code == 200 and name not in ZONE_A for code, name in pod.calls(10)), 20,
                   "traffic to fail over to zone-b")
        answered = pod.calls(40)
        assert {code for code, _ in answered} == {200}
        assert {name for _, name in answered} == {"echo-b1", "echo-b2"}
        stats = dict(line.partition(": ")[::2] for line in pod.envoy.get("/stats")[1].splitlines())
        ejected = [int(v) for n, v in stats.items()
                   if "echo.shop" in n and n.endswith("outlier_detection.ejections_enforced_consecutive_5xx")]
        assert ejected == [2], ejected  # both zone-a pods, by outlier detection
    finally:
        for name in ZONE_A:
            (pod.failing / name).unlink()


def test_distribute_splits_by_weight(pod: Pod) -> None:
    pod.apply(DISTRIBUTE)
    wait_until(lambda: set(_priorities(pod.envoy).values()) == {0}
               and "echo-b1" in {name for _, name in pod.calls(20)} | {name for _, name in pod.calls(20)}, 20,
               "the distribute rule in Envoy")
    answered = pod.calls(400)
    assert {code for code, _ in answered} == {200}
    zones = Counter("a" if name in ZONE_A else "b" for _, name in answered)
    share = zones["a"] / len(answered)
    # 70% to zone-a: within 5 standard deviations of a binomial draw (0.70 +- 0.115 for 400 calls).
    bound = 5 * math.sqrt(0.7 * 0.3 / len(answered))
    print(f"distribute 70/30: zone-a answered {zones['a']} of {len(answered)} ({share:.3f})")
    assert abs(share - 0.7) < bound, zones


PROXYLESS_FAILOVER = """apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: echo, namespace: echo-ns}
spec:
  host: echo
  trafficPolicy: {outlierDetection: {consecutive5xxErrors: 2}}
"""
PROXYLESS_DISTRIBUTE = """apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: echo, namespace: echo-ns}
spec:
  host: echo
  trafficPolicy: {loadBalancer: {localityLbSetting: {distribute: [{from: "r1/zone-a/*", to: {"r1/zone-a/*": 80, "r1/zone-b/*": 20}}]}}}
"""


def _proxyless_mesh(mesh_dir: Path, start_demo: Callable[..., Process], rule: str) -> dict[str, Process]:
    """Service echo in echo-ns with a server in r1/zone-a and one in r1/zone-b (their pods'
    istio-locality label), the client's own pod in r1/zone-a, and `rule`: the servers by pod name."""
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="echo", namespace="echo-ns", port=SERVICE_PORT))
    servers = {}
    for pod, ip, zone in (("echo-a", "127.0.0.21", "zone-a"), ("echo-b", "127.0.0.22", "zone-b")):
        port = free_port(ip)
        servers[pod] = start_demo("server", "--address", f"{ip}:{port}", "--name", pod, name=pod)
        servers[pod].next_json(15)
        text = render("pod.yaml", pod=pod, app="echo", namespace="echo-ns", ip=ip, port=port)
        (mesh_dir / f"{pod}.yaml").write_text(text.replace("labels: {app: echo,", f"labels: {{app: echo, istio-locality: r1.{zone},"))
    # The client's own pod (the demo client's node ID names `demo-client`): istiod takes its locality from it.
    client_pod = render("pod.yaml", pod="demo-client", app="client", namespace="echo-ns", ip="127.0.0.1", port=1)
    (mesh_dir / "client.yaml").write_text(client_pod.replace("labels: {app: client,", "labels: {app: client, istio-locality: r1.zone-a,"))
    (mesh_dir / "dr.yaml").write_text(rule)
    return servers


def _replies(client: Process, count: int) -> Counter[str]:
    return Counter(line["reply"].split()[0] if line["ok"] else line["code"]
                   for line in (client.next_json(10) for _ in range(count)))


def test_proxyless_grpc_client_takes_priorities(mesh_dir: Path, start_istiod: Callable[..., Istiod],
                                                start_demo: Callable[..., Process]) -> None:
    """gRPC's xDS client balances by EDS priority: zone-a only, then zone-b once zone-a's server is gone
    (gRPC leaves a priority whose endpoints all fail to connect; its outlier detection knows no
    consecutive errors, so a server answering errors does not move it)."""
    servers = _proxyless_mesh(mesh_dir, start_demo, PROXYLESS_FAILOVER)
    istiod = start_istiod(mesh_dir)
    client = start_demo("client", f"xds:///echo.echo-ns.svc.cluster.local:{SERVICE_PORT}", "--xds", istiod.xds_address,
                        "--count", "0", "--interval", "0.02", "--timeout", "2", "--namespace", "echo-ns", name="client")
    wait_until(lambda: any(line.get("ok") for line in client.drain()), 20, "the client's first reply")
    assert _replies(client, 50) == {"echo-a": 50}

    servers["echo-a"].stop()
    wait_until(lambda: any(line.get("ok") and line["reply"].startswith("echo-b") for line in client.drain()), 20,
               "the client to fail over to zone-b")
    assert _replies(client, 30) == {"echo-b": 30}


def test_proxyless_grpc_client_takes_locality_weights(mesh_dir: Path, start_istiod: Callable[..., Istiod],
                                                      start_demo: Callable[..., Process]) -> None:
    """distribute's weights are gRPC's locality weights (and it takes the cluster's locality weighted LB config)."""
    _proxyless_mesh(mesh_dir, start_demo, PROXYLESS_DISTRIBUTE)
    istiod = start_istiod(mesh_dir)
    n = 1000
    client = start_demo("client", f"xds:///echo.echo-ns.svc.cluster.local:{SERVICE_PORT}", "--xds", istiod.xds_address,
                        "--count", str(n), "--interval", "0", "--timeout", "5", "--namespace", "echo-ns", name="client")
    seen = _replies(client, n)
    share = seen["echo-a"] / n
    bound = 5 * math.sqrt(0.8 * 0.2 / n)  # 5 standard deviations of a binomial draw: 0.80 +- 0.063
    print(f"proxyless distribute 80/20 over {n} calls: {dict(seen)}; zone-a share {share:.3f}")
    assert set(seen) == {"echo-a", "echo-b"} and abs(share - 0.8) < bound, seen

"""VirtualService and DestinationRule carrying real traffic through a real Envoy sidecar.

One pod (web-1, an Envoy in its own network namespace behind istio-init's capture, configured by
istiod on loopback) calls Service echo, whose versions v1 and v2 answer inside the same namespace
on 127.0.0.41 and .42 saying who they are and what request they got, and HTTPS servers outside the
mesh (ServiceEntry hosts, on .43 and .44) that its sidecar originates TLS to. curl in the pod is
the client. Config: tests/data/envoy-routing-mesh.yaml and envoy-routing-policy.yaml.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from istiod.ca.pki import cert_pem, key_pem, new_key
from tests.conftest import DATA, render
from tests.envoy_peer import Envoy, sidecar_envoy
from tests.peers import Istiod, Process, wait_until
from tests.pki import ca_cert, leaf_cert
from tests.pods import wait_serving
from tests.test_envoy_sidecar import _acked, _dynamic, captured_pod

ECHO = "echo.shop.svc.cluster.local"
ECHO_VIP = "10.96.0.20"
ROUTE_NAMES = ["header", "abort", "delay", "rewrite", "moved", "direct", "split"]
CLIENT_ID = "spiffe://cluster.local/ns/shop/sa/web"


@dataclass
class Pod:
    istiod: Istiod
    envoy: Envoy
    run: Callable[..., subprocess.CompletedProcess[str]]
    config: Path  # the config dir istiod watches
    backends: dict[str, Process] = field(default_factory=dict)  # by name; each logs the requests it got

    def curl(self, *args: str, host: str = "echo", url: str = f"http://{ECHO_VIP}/") -> str:
        """curl in the pod; the VIP is captured whatever the Host (the route picks by Host)."""
        done = self.run("curl", "-s", "--max-time", "10", "-H", f"Host: {host}", *args, url)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def get(self, path: str, *args: str, host: str = "echo") -> dict[str, Any]:
        return json.loads(self.curl(*args, host=host, url=f"http://{ECHO_VIP}{path}"))

    def stats(self, contains: str) -> dict[str, int]:
        lines = self.envoy.get("/stats")[1].splitlines()
        return {n: int(v) for n, _, v in (line.partition(": ") for line in lines) if contains in n and v.isdigit()}


def _certificates(directory: Path) -> dict[str, Path]:
    """A CA with HTTPS server certificates for the ServiceEntry hosts and a client certificate, and
    another CA that signed none of them."""
    ca_key, other_key = new_key(), new_key()
    ca = ca_cert("routing test CA", ca_key)
    files: dict[str, Path] = {}

    def write(name: str, text: str | bytes) -> None:
        files[name] = directory / f"{name}.pem"
        files[name].write_bytes(text.encode() if isinstance(text, str) else text)

    write("ca", cert_pem(ca))
    write("other_ca", cert_pem(ca_cert("another CA", other_key)))
    for name, uris, dns in (("secure", (), ("secure.example.com", "untrusted.example.com")),
                            ("mutual", (), ("mutual.example.com",)),
                            ("client", (CLIENT_ID,), ())):
        key = new_key()
        write(f"{name}_cert", cert_pem(leaf_cert(key, (ca, ca_key), uris=uris, dns=dns)))
        write(f"{name}_key", key_pem(key))
    return files


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (Debian's package) for the capture rules")
    workdir = tmp_path_factory.mktemp("envoy-routing")
    config = workdir / "mesh"
    config.mkdir()
    for name in ("sidecar-mesh.yaml", "envoy-routing-mesh.yaml"):
        shutil.copy(DATA / name, config / name)
    certs = _certificates(workdir)
    istiod = Istiod(workdir, "--config-dir", str(config), "--poll-interval", "100ms")
    try:
        with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as envoy, \
                captured_pod(istiod, envoy) as run:
            assert run("ip", "addr", "add", f"{ECHO_VIP}/32", "dev", "lo").returncode == 0  # a route to the VIP
            servers = [(f"echo-{v}", f"127.0.0.4{i}:8080", ()) for i, v in ((1, "v1"), (2, "v2"))] + [
                ("secure", "127.0.0.43:8443", ("--cert", str(certs["secure_cert"]), "--key", str(certs["secure_key"]))),
                ("mutual", "127.0.0.44:8443", ("--cert", str(certs["mutual_cert"]), "--key", str(certs["mutual_key"]),
                                               "--client-ca", str(certs["ca"])))]
            backends = [Process(envoy.netns(sys.executable, "-m", "istiod.demo.apps", "http-server", "--address",
                                            address, "--name", name, *tls), name=name)
                        for name, address, tls in servers]
            try:
                for backend in backends:
                    wait_serving(backend)
                (config / "policy.yaml").write_text(render("envoy-routing-policy.yaml", **certs))
                wait_until(lambda: _echo_route_names(envoy) == ROUTE_NAMES, 20, "the VirtualService's routes in Envoy")
                _acked(istiod, envoy)
                yield Pod(istiod, envoy, run, config, {b.name: b for b in backends})
            finally:
                for backend in backends:
                    backend.stop()
    finally:
        istiod.stop()


def _echo_route_names(envoy: Envoy) -> list[str]:
    routes = _dynamic(envoy.config_dump(), "routes").get("80", {})
    host = next((h for h in routes.get("virtual_hosts", []) if h["name"] == f"{ECHO}:80"), {})
    return [r.get("name", "") for r in host.get("routes", [])]


LEGACY = """apiVersion: v1
kind: Service
metadata: {name: legacy, namespace: shop}
spec:
  clusterIP: 10.96.0.21
  selector: {app: legacy}
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: legacy-1, namespace: shop}
spec: {address: 127.0.0.41, labels: {app: legacy}}
---
apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: legacy-2, namespace: shop}
spec: {address: 127.0.0.42, labels: {app: legacy}, weight: 3}
"""


def test_a_service_selecting_workload_entries_balances_by_their_weight(pod: Pod) -> None:
    """A Kubernetes Service whose selector picks WorkloadEntries (VMs: here the echo servers'
    addresses) has them as endpoints, as Istio's registry adds them; weight 3 against the default
    1 gets three requests in four (Envoy's weighted least-request, one request at a time)."""
    (pod.config / "legacy.yaml").write_text(LEGACY)
    assert pod.run("ip", "addr", "add", "10.96.0.21/32", "dev", "lo").returncode == 0
    try:
        wait_until(lambda: '"name"' in pod.curl(host="legacy", url="http://10.96.0.21/"), 20,
                   "the Service's WorkloadEntries behind the sidecar")
        n = 400
        bodies = pod.curl("-w", "\n", host="legacy", url=f"http://10.96.0.21/w/[1-{n}]").splitlines()
        seen = Counter(json.loads(body)["name"] for body in bodies)
        print(f"WorkloadEntries weighted 1 and 3, {n} requests: {dict(seen)}")
        assert sum(seen.values()) == n and 0.2 * n <= seen["echo-v1"] <= 0.3 * n, seen
    finally:
        (pod.config / "legacy.yaml").unlink()
        pod.run("ip", "addr", "del", "10.96.0.21/32", "dev", "lo")


def test_canary_split_90_10(pod: Pod) -> None:
    n = 2000
    # One connection, n requests (curl's URL range): Envoy picks a weighted cluster per request.
    bodies = pod.curl("-w", "\n", url=f"http://{ECHO_VIP}/split/[1-{n}]").splitlines()
    seen = Counter(json.loads(body)["name"] for body in bodies)
    v1 = seen["echo-v1"]
    # v1 ~ Binomial(2000, 0.9): mean 1800, sd 13.4. Accepting 1700..1900 (7.45 sd either side) fails a
    # correct split with probability < 2*exp(-100**2/(2*2000*0.09+2/3*100)) ~ 2e-10 (Bernstein).
    sd = math.sqrt(n * 0.9 * 0.1)
    print(f"90/10 split over {n} requests through Envoy: {dict(seen)}; v1 share {v1 / n:.3f} "
          f"({(v1 - 0.9 * n) / sd:+.2f} sd)")
    assert sum(seen.values()) == n and set(seen) == {"echo-v1", "echo-v2"} and 1700 <= v1 <= 1900, seen


GAMMA = """apiVersion: v1
kind: Service
metadata: {name: echo-v1, namespace: shop}
spec:
  clusterIP: 10.96.0.22
  selector: {app: echo, version: v1}
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: echo-v2, namespace: shop}
spec:
  clusterIP: 10.96.0.23
  selector: {app: echo, version: v2}
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: split, namespace: shop}
spec:
  parentRefs: [{group: "", kind: Service, name: echo, port: 80}]
  rules:
  - backendRefs: [{name: echo-v1, port: 80, weight: 70}, {name: echo-v2, port: 80, weight: 30}]
"""


def test_a_weighted_http_route_on_the_service_splits_the_sidecars_calls(pod: Pod) -> None:
    """GAMMA: an HTTPRoute whose parent is Service echo takes the host's routes from the
    VirtualService (a public one) while it exists; they come back when it is deleted."""
    (pod.config / "gamma.yaml").write_text(GAMMA)
    try:
        wait_until(lambda: _echo_route_names(pod.envoy) == ["shop.split.0"], 20, "the HTTPRoute's route in Envoy")
        n, p = 1000, 0.7
        bodies = pod.curl("-w", "\n", url=f"http://{ECHO_VIP}/gamma/[1-{n}]").splitlines()
        seen = Counter(json.loads(body)["name"] for body in bodies)
        sd = math.sqrt(n * p * (1 - p))
        print(f"HTTPRoute 70/30 on Service echo, {n} requests through Envoy: {dict(seen)}; "
              f"v1 {(seen['echo-v1'] - p * n) / sd:+.2f} sd")
        assert sum(seen.values()) == n and abs(seen["echo-v1"] - p * n) <= 5 * sd, seen
    finally:
        (pod.config / "gamma.yaml").unlink()
        wait_until(lambda: _echo_route_names(pod.envoy) == ROUTE_NAMES, 20, "the VirtualService's routes again")


def test_header_route_to_a_subset(pod: Pod) -> None:
    """x-canary: yes goes to subset v2 only; the subset's endpoints are those labelled version: v2."""
    canary = Counter(pod.get(f"/h/{i}", "-H", "x-canary: yes")["name"] for i in range(30))
    other = Counter(pod.get(f"/h/{i}", "-H", "x-canary: no")["name"] for i in range(30))
    print(f"header route: x-canary: yes -> {dict(canary)}, x-canary: no -> {dict(other)} (the 90/10 split)")
    assert canary == {"echo-v2": 30}
    endpoints = _dynamic(pod.envoy.config_dump(), "endpoints")
    addresses = {version: [e["endpoint"]["address"]["socket_address"]["address"]
                           for e in endpoints[f"outbound|80|{version}|{ECHO}"]["endpoints"][0]["lb_endpoints"]]
                 for version in ("v1", "v2")}
    assert addresses == {"v1": ["127.0.0.41"], "v2": ["127.0.0.42"]}


def test_fault_abort_is_the_status_curl_sees(pod: Pod) -> None:
    lines = [pod.curl("-w", " %{http_code}", url=f"http://{ECHO_VIP}/abort/{i}") for i in range(10)]
    print(f"abort 418: curl printed {lines[0]!r}")
    assert all(line == "fault filter abort 418" for line in lines), lines


def test_fault_delay_measured(pod: Pod) -> None:
    def timed(path: str) -> list[float]:
        out = pod.curl("-o", "/dev/null", "-w", "%{http_code} %{time_total}\n", url=f"http://{ECHO_VIP}{path}[1-8]")
        codes, times = zip(*(line.split() for line in out.splitlines()))
        assert set(codes) == {"200"}, out
        return [float(t) for t in times]

    delayed, plain = timed("/delay/"), timed("/split/")
    print(f"delay 500ms: median {statistics.median(delayed) * 1000:.0f} ms (min {min(delayed) * 1000:.0f}), "
          f"without the fault: median {statistics.median(plain) * 1000:.1f} ms")
    # Envoy's timers run on its cached clock and may fire a few ms early (498 ms seen for 500).
    assert min(delayed) >= 0.45 and statistics.median(plain) < 0.25


def test_rewrite_and_header_operations_reach_the_backend_and_the_client(pod: Pod) -> None:
    out = pod.curl("-i", "-H", "x-set: original", "-H", "x-drop: secret", "-H", "x-keep: kept",
                   url=f"http://{ECHO_VIP}/old/thing?q=1")
    head, _, body = out.replace("\r\n", "\n").partition("\n\n")
    seen = json.loads(body)
    response = dict(line.lower().split(": ", 1) for line in head.splitlines()[1:])
    print(f"the backend got {seen['path']} for Host {seen['headers']['host']}; headers "
          f"{ {k: v for k, v in seen['headers'].items() if k.startswith('x-') and not k.startswith('x-envoy')} }; "
          f"the client got {response}")
    assert seen["name"] == "echo-v1" and seen["path"] == "/new/thing?q=1"
    assert seen["headers"]["host"] == "rewritten.example"
    assert (seen["headers"]["x-set"], seen["headers"]["x-added"], seen["headers"]["x-keep"]) == (
        "overwritten", "yes", "kept")
    assert "x-drop" not in seen["headers"]
    assert (response["x-served-by"], response["x-share"], response["x-route"]) == ("mesh", "100%", "rewrite")
    assert "content-type" not in response
    # Other routes leave both directions alone.
    plain = pod.get("/split/plain", "-H", "x-drop: secret")
    assert plain["headers"]["x-drop"] == "secret" and plain["headers"]["host"] == "echo"


def test_redirect_and_direct_response_come_from_the_sidecar(pod: Pod) -> None:
    moved = pod.curl("-o", "/dev/null", "-w", "%{http_code} %{redirect_url}", url=f"http://{ECHO_VIP}/moved/x")
    direct = pod.curl("-w", "%{http_code}", url=f"http://{ECHO_VIP}/direct")
    print(f"redirect: {moved}; direct response: {direct!r}")
    assert moved == "307 http://other.example/elsewhere"
    assert direct == "straight from the sidecar\n200"


def test_simple_tls_origination_to_a_service_entry_host(pod: Pod) -> None:
    """The app speaks plain HTTP; its sidecar speaks TLS to the server, verifying it with the
    DestinationRule's CA and SNI and SAN from the Host (istiod's auto SNI)."""
    seen = pod.get("/over-tls", host="secure.example.com")
    print(f"secure.example.com, DestinationRule SIMPLE: the server saw {seen['tls']}, Host {seen['headers']['host']}")
    assert seen["name"] == "secure" and seen["path"] == "/over-tls"
    assert seen["tls"]["sni"] == "secure.example.com" and seen["tls"]["version"] in ("TLSv1.2", "TLSv1.3")
    assert seen["tls"]["client"] is None  # SIMPLE: no client certificate

    # The same server trusted through another CA: Envoy refuses it and the app gets a 503.
    before = pod.stats("outbound|80||untrusted.example.com.ssl.fail_verify_error")
    refused = pod.curl("-w", " %{http_code}", host="untrusted.example.com", url=f"http://{ECHO_VIP}/x")
    after = pod.stats("outbound|80||untrusted.example.com.ssl.fail_verify_error")
    print(f"untrusted.example.com (another CA): curl printed {refused[-80:]!r}; Envoy's {after}")
    assert refused.endswith(" 503") and sum(after.values()) > sum(before.values())


def test_mutual_tls_origination_presents_the_client_certificate(pod: Pod) -> None:
    seen = pod.get("/mutual", host="mutual.example.com")
    print(f"mutual.example.com, DestinationRule MUTUAL: the server saw {seen['tls']}")
    assert seen["name"] == "mutual" and seen["tls"]["client"] == [CLIENT_ID]

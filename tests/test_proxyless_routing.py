"""VirtualService and DestinationRule through real gRPC xDS clients (grpcio, in subprocesses)."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import render
from tests.peers import Istiod, Process, free_port, wait_until
from tests.test_proxyless_grpc import SERVICE_PORT, start_client, wait_for_replies

HOST = "echo.echo-ns.svc.cluster.local"
TARGET = f"xds:///{HOST}:{SERVICE_PORT}"
SUBSETS = """apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: echo, namespace: echo-ns}
spec:
  host: echo
  subsets:
  - {name: v1, labels: {version: v1}}
  - {name: v2, labels: {version: v2}}
"""


def virtual_service(http: str) -> str:
    return ("apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: echo, namespace: echo-ns}\n"
            f"spec:\n  hosts: [echo]\n  http:\n{http}")


@pytest.fixture
def versioned_mesh(mesh_dir: Path, start_demo: Callable[..., Process]) -> Path:
    """Service `echo` in `echo-ns` with pods echo-v1 (version v1) and echo-v2 (version v2), both live."""
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="echo", namespace="echo-ns", port=SERVICE_PORT))
    for version, ip in (("v1", "127.0.0.21"), ("v2", "127.0.0.22")):
        pod = f"echo-{version}"
        port = free_port(ip)
        start_demo("server", "--address", f"{ip}:{port}", "--name", pod, name=pod).next_json(15)
        text = render("pod.yaml", pod=pod, app="echo", namespace="echo-ns", ip=ip, port=port)
        # The shared pod fixture has no version label; subsets select on it.
        (mesh_dir / f"{pod}.yaml").write_text(text.replace("labels: {app: echo,", f"labels: {{app: echo, version: {version},"))
    (mesh_dir / "dr.yaml").write_text(SUBSETS)
    return mesh_dir


def calls(client: Process, count: int) -> list[dict]:
    return [client.next_json(30) for _ in range(count)]


def counted_client(start_demo: Callable[..., Process], istiod: Istiod, count: int, *extra: str, name: str = "client",
                   target: str = TARGET) -> Process:
    """A client in echo-ns making `count` calls 10 ms apart."""
    return start_demo("client", target, "--xds", istiod.xds_address, "--count", str(count), "--interval", "0.01",
                      "--namespace", "echo-ns", *extra, name=name)


def outcomes(client: Process, count: int) -> Counter[str]:
    """Replies by backend (pod name), failures by code."""
    return Counter(l["reply"].split()[0] if l["ok"] else l["code"] for l in calls(client, count))


def test_weighted_split_90_10(versioned_mesh: Path, start_istiod: Callable[..., Istiod],
                              start_demo: Callable[..., Process]) -> None:
    (versioned_mesh / "vs.yaml").write_text(virtual_service(
        "  - route:\n"
        "    - {destination: {host: echo, subset: v1}, weight: 90}\n"
        "    - {destination: {host: echo, subset: v2}, weight: 10}\n"))
    istiod = start_istiod(versioned_mesh)
    n = 2000
    client = start_demo("client", TARGET, "--xds", istiod.xds_address, "--count", str(n), "--interval", "0",
                        "--timeout", "5", "--namespace", "echo-ns", name="client")
    seen = outcomes(client, n)
    v1 = seen["echo-v1"]
    # v1 ~ Binomial(2000, 0.9): mean 1800, sd 13.4. Accepting 1700..1900 (7.45 sd either side) fails a
    # correct split with probability < 2*exp(-100**2/(2*2000*0.09+2/3*100)) ~ 2e-10 (Bernstein).
    sd = math.sqrt(n * 0.9 * 0.1)
    print(f"90/10 split over {n} calls: {dict(seen)}; v1 share {v1 / n:.3f} ({(v1 - 0.9 * n) / sd:+.2f} sd)")
    assert set(seen) == {"echo-v1", "echo-v2"} and 1700 <= v1 <= 1900, seen


def test_subset_routing_and_a_change_within_2s(versioned_mesh: Path, start_istiod: Callable[..., Istiod],
                                               start_demo: Callable[..., Process]) -> None:
    route_to = "  - route: [{destination: {host: echo, subset: %s}}]\n"
    (versioned_mesh / "vs.yaml").write_text(virtual_service(route_to % "v1"))
    istiod = start_istiod(versioned_mesh)
    client = start_client(start_demo, istiod, TARGET)
    wait_until(lambda: any(l["ok"] for l in client.drain()), 15, "a first reply")
    wait_for_replies(client, {"echo-v1"}, timeout=5)
    (versioned_mesh / "vs.yaml").write_text(virtual_service(route_to % "v2"))
    took = wait_for_replies(client, {"echo-v2"})
    print(f"subset v1 -> v2 seen by the client in {took:.2f}s")
    (versioned_mesh / "vs.yaml").unlink()
    took = wait_for_replies(client, {"echo-v1", "echo-v2"})
    print(f"VirtualService deleted: both pods again in {took:.2f}s")


def test_header_and_method_routing(versioned_mesh: Path, start_istiod: Callable[..., Istiod],
                                   start_demo: Callable[..., Process]) -> None:
    (versioned_mesh / "vs.yaml").write_text(virtual_service(
        "  - match: [{headers: {x-user: {exact: canary}}, uri: {exact: /demo.Echo/Echo}}]\n"
        "    route: [{destination: {host: echo, subset: v2}}]\n"
        "  - match: [{uri: {regex: '/demo\\.Echo/.*'}}]\n"
        "    route: [{destination: {host: echo, subset: v1}}]\n"))
    istiod = start_istiod(versioned_mesh)
    canary = counted_client(start_demo, istiod, 40, "--header", "x-user=canary", name="canary")
    other = counted_client(start_demo, istiod, 40, "--header", "x-user=someone", name="other")
    seen = {"canary": outcomes(canary, 40), "other": outcomes(other, 40)}
    print(f"header routing: {seen}")
    assert seen == {"canary": {"echo-v2": 40}, "other": {"echo-v1": 40}}


def test_fault_abort_and_delay(versioned_mesh: Path, start_istiod: Callable[..., Istiod],
                               start_demo: Callable[..., Process]) -> None:
    (versioned_mesh / "vs.yaml").write_text(virtual_service(
        "  - match: [{headers: {x-fault: {exact: abort}}}]\n"
        "    fault: {abort: {grpcStatus: RESOURCE_EXHAUSTED, percentage: {value: 100}}}\n"
        "    route: [{destination: {host: echo}}]\n"
        "  - match: [{headers: {x-fault: {exact: delay}}}]\n"
        "    fault: {delay: {fixedDelay: 300ms, percentage: {value: 100}}}\n"
        "    route: [{destination: {host: echo}}]\n"
        "  - route: [{destination: {host: echo}}]\n"))
    istiod = start_istiod(versioned_mesh)
    abort = counted_client(start_demo, istiod, 10, "--header", "x-fault=abort", name="abort")
    delay = counted_client(start_demo, istiod, 10, "--header", "x-fault=delay", name="delay")
    plain = counted_client(start_demo, istiod, 10, name="plain")
    aborted = calls(abort, 10)
    print(f"abort: {Counter(l.get('code') for l in aborted)}, e.g. {aborted[-1]}")
    assert all(l["code"] == "RESOURCE_EXHAUSTED" for l in aborted)
    # The first call also waits for xDS; the rest show the injected delay alone.
    delayed = [l["ms"] for l in calls(delay, 10)[1:]]
    undelayed = [l["ms"] for l in calls(plain, 10)[1:]]
    print(f"delay 300ms: median {statistics.median(delayed)} ms (min {min(delayed)}), "
          f"without the header: median {statistics.median(undelayed)} ms")
    assert min(delayed) >= 300 and statistics.median(undelayed) < 300


def test_timeout_as_max_stream_duration(versioned_mesh: Path, start_istiod: Callable[..., Istiod],
                                        start_demo: Callable[..., Process]) -> None:
    (versioned_mesh / "vs.yaml").write_text(virtual_service(
        "  - fault: {delay: {fixedDelay: 1s, percentage: {value: 100}}}\n"
        "    timeout: 200ms\n"
        "    route: [{destination: {host: echo}}]\n"))
    istiod = start_istiod(versioned_mesh)
    client = counted_client(start_demo, istiod, 5, "--timeout", "5")
    lines = calls(client, 5)[1:]
    print(f"timeout 200ms over a 1s delay: {[(l.get('code'), l['ms']) for l in lines]}")
    assert all(l["code"] == "DEADLINE_EXCEEDED" and l["ms"] < 1000 for l in lines)


@pytest.mark.parametrize("algorithm", ["", ", ringHash: {minimumRingSize: 64}", ", maglev: {tableSize: 65537}"])
def test_consistent_hash_by_header(algorithm: str, versioned_mesh: Path, start_istiod: Callable[..., Istiod],
                                   start_demo: Callable[..., Process]) -> None:
    """gRPC's ring hash on the header; maglev (which gRPC lacks) is sent as a ring hash."""
    (versioned_mesh / "dr.yaml").write_text(SUBSETS.replace(
        "spec:\n", f"spec:\n  trafficPolicy: {{loadBalancer: {{consistentHash: {{httpHeaderName: x-user{algorithm}}}}}}}\n"))
    istiod = start_istiod(versioned_mesh)
    users = {}
    for user in ("alice", "bob", "carol", "dave"):
        client = counted_client(start_demo, istiod, 20, "--header", f"x-user={user}", name=user)
        users[user] = outcomes(client, 20)
    print(f"RING_HASH on x-user{algorithm}: {users}")
    # Each user sticks to one pod (with round robin every user would see both).
    assert all(len(seen) == 1 and next(iter(seen)).startswith("echo-") for seen in users.values())


@pytest.mark.parametrize("lb", ["LEAST_REQUEST", "ROUND_ROBIN"])
def test_cluster_policy_is_accepted(lb: str, versioned_mesh: Path, start_istiod: Callable[..., Istiod],
                                    start_demo: Callable[..., Process]) -> None:
    """Load balancer, outlier detection and circuit breaker as gRPC takes them, and what it ignores
    (slow start, keepalive, HTTP options, PROXY protocol): ACKed, and calls flow."""
    (versioned_mesh / "dr.yaml").write_text(SUBSETS.replace("spec:\n", (
        "spec:\n  trafficPolicy:\n"
        f"    loadBalancer: {{simple: {lb}, warmup: {{duration: 10s}}}}\n"
        "    connectionPool:\n"
        "      http: {http2MaxRequests: 100, idleTimeout: 30s, h2UpgradePolicy: UPGRADE}\n"
        "      tcp: {tcpKeepalive: {time: 60s}, maxConnectionDuration: 1h}\n"
        "    proxyProtocol: {version: V2}\n"
        "    outlierDetection: {consecutive5xxErrors: 5, interval: 10s, baseEjectionTime: 30s, maxEjectionPercent: 50}\n"
        "    tls: {mode: DISABLE}\n")))
    istiod = start_istiod(versioned_mesh)
    seen = outcomes(counted_client(start_demo, istiod, 20), 20)
    status, syncz = istiod.get("/debug/syncz")
    sync = next(s for s in syncz if "demo-client" in s["proxy"])
    print(f"{lb} + warmup + outlierDetection + connectionPool + proxyProtocol: {dict(seen)}; {sync}")
    assert set(seen) == {"echo-v1", "echo-v2"}
    assert sync["cluster_sent"] and sync["cluster_sent"] == sync["cluster_acked"]


@pytest.mark.parametrize(("retries", "expect_failures"), [
    ("", False),  # istiod's default policy retries UNAVAILABLE twice
    ("    retries: {attempts: 3, retryOn: unavailable, perTryTimeout: 2s}\n", False),
    # gRPC's retry policy takes the back-off (and ignores the host predicate).
    ("    retries: {attempts: 3, retryOn: unavailable, backoff: 10ms, retryIgnorePreviousHosts: false}\n", False),
    ("    retries: {attempts: 3, retryOn: resource-exhausted}\n", True),  # not the code the server fails with
    ("    retries: {attempts: 0}\n", True),
])
def test_retries(retries: str, expect_failures: bool, mesh_dir: Path, start_istiod: Callable[..., Istiod],
                 start_demo: Callable[..., Process]) -> None:
    """A backend failing every 2nd call with UNAVAILABLE: a retry lands on the next, good, call."""
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="echo", namespace="echo-ns", port=SERVICE_PORT))
    ip = "127.0.0.23"
    port = free_port(ip)
    start_demo("server", "--address", f"{ip}:{port}", "--name", "flaky", "--fail-every", "2", name="flaky").next_json(15)
    (mesh_dir / "pod.yaml").write_text(render("pod.yaml", pod="flaky", app="echo", namespace="echo-ns", ip=ip, port=port))
    (mesh_dir / "vs.yaml").write_text(virtual_service(f"  - route: [{{destination: {{host: echo}}}}]\n{retries}"))
    istiod = start_istiod(mesh_dir)
    seen = Counter("ok" if l["ok"] else l["code"] for l in calls(counted_client(start_demo, istiod, 20), 20))
    print(f"retries {retries.strip() or '(istiod default)'}: {dict(seen)}")
    assert (seen["UNAVAILABLE"] >= 5) if expect_failures else (seen == {"ok": 20})


@pytest.mark.parametrize(("resolution", "address"), [("STATIC", "127.0.0.24"), ("DNS", "localhost")])
def test_service_entry_host_is_callable_by_name(resolution: str, address: str, mesh_dir: Path,
                                                start_istiod: Callable[..., Istiod],
                                                start_demo: Callable[..., Process]) -> None:
    ip = "127.0.0.24" if resolution == "STATIC" else "127.0.0.1"
    port = free_port(ip)
    start_demo("server", "--address", f"{ip}:{port}", "--name", "outside", name="outside").next_json(15)
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "se.yaml").write_text(
        "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: outside, namespace: echo-ns}\n"
        "spec:\n  hosts: [outside.example.test]\n  ports: [{number: 7070, name: grpc, protocol: GRPC}]\n"
        f"  resolution: {resolution}\n  endpoints: [{{address: {address}, ports: {{grpc: {port}}}}}]\n")
    istiod = start_istiod(mesh_dir)
    client = counted_client(start_demo, istiod, 5, target="xds:///outside.example.test:7070")
    lines = calls(client, 5)
    status, syncz = istiod.get("/debug/syncz")
    print(f"ServiceEntry {resolution} ({address}): {[l.get('reply') or l.get('error') for l in lines][:2]}; "
          f"cluster NACK: {next(s for s in syncz if 'demo-client' in s['proxy']).get('cluster_nacked_error')}")
    assert all(l["ok"] and l["reply"].startswith("outside ") for l in lines)


def test_a_service_selecting_a_workload_entry_reaches_it(versioned_mesh: Path, start_istiod: Callable[..., Istiod],
                                                        start_demo: Callable[..., Process]) -> None:
    """Service echo's selector (app: echo) also picks a WorkloadEntry, a VM at its own port named
    as the Service's targetPort (grpc): gRPC calls reach it beside the Pods, until it is deleted."""
    ip = "127.0.0.25"
    port = free_port(ip)
    start_demo("server", "--address", f"{ip}:{port}", "--name", "vm", name="vm").next_json(15)
    (versioned_mesh / "we.yaml").write_text(
        "apiVersion: networking.istio.io/v1\nkind: WorkloadEntry\nmetadata: {name: vm, namespace: echo-ns}\n"
        f"spec: {{address: {ip}, labels: {{app: echo}}, ports: {{grpc: {port}}}}}\n")
    istiod = start_istiod(versioned_mesh)
    seen = outcomes(counted_client(start_demo, istiod, 60), 60)
    print(f"Pods and a WorkloadEntry behind Service echo: {dict(seen)}")
    assert set(seen) == {"echo-v1", "echo-v2", "vm"}, seen
    (versioned_mesh / "we.yaml").unlink()
    later = counted_client(start_demo, istiod, 1000, name="later")

    def without_vm() -> bool:  # 30 replies in a row, none from the VM
        return all(not later.next_json(30).get("reply", "").startswith("vm ") for _ in range(30))

    wait_until(without_vm, 20, "the deleted WorkloadEntry to leave the endpoints")


def test_a_client_in_the_namespace_dials_name_port(versioned_mesh: Path, start_istiod: Callable[..., Istiod],
                                                   start_demo: Callable[..., Process]) -> None:
    (versioned_mesh / "vs.yaml").write_text(virtual_service("  - route: [{destination: {host: echo, subset: v2}}]\n"))
    istiod = start_istiod(versioned_mesh)
    client = counted_client(start_demo, istiod, 5, target=f"xds:///echo:{SERVICE_PORT}")
    replies = [l.get("reply") or l.get("error") for l in calls(client, 5)]
    print(f"xds:///echo:{SERVICE_PORT} from echo-ns: {replies[0]}")
    assert all(r.startswith("echo-v2 ") for r in replies), replies


def test_route_actions_grpc_lacks(versioned_mesh: Path, start_istiod: Callable[..., Istiod],
                                  start_demo: Callable[..., Process]) -> None:
    """gRPC takes the route configuration with a redirect in it (no NACK) and fails only the calls
    that route matches; header operations, rewrites, mirrors and CORS policies are not sent to it
    at all (gRPC has no CORS filter: its config would be a NACK)."""
    (versioned_mesh / "vs.yaml").write_text(virtual_service(
        "  - match: [{headers: {x-go: {exact: away}}}]\n"
        "    redirect: {uri: /elsewhere}\n"
        "  - headers: {request: {set: {x-added: 'yes'}}}\n"
        "    rewrite: {uri: /demo.Echo/Other}\n"
        "    mirror: {host: echo, subset: v2}\n"
        "    corsPolicy: {allowOrigins: [{exact: 'https://a.example'}]}\n"
        "    route: [{destination: {host: echo, subset: v1}}]\n"))
    istiod = start_istiod(versioned_mesh)
    redirected = calls(counted_client(start_demo, istiod, 5, "--header", "x-go=away", name="redirected"), 5)
    plain = outcomes(counted_client(start_demo, istiod, 5, name="plain"), 5)
    status, syncz = istiod.get("/debug/syncz")
    nacks = [s.get("route_nacked_error") for s in syncz if s.get("route_nacked_error")]
    print(f"redirect route: {Counter(l.get('code') for l in redirected)}, e.g. {redirected[-1].get('error')!r}; "
          f"other calls: {dict(plain)}; route NACKs: {nacks}")
    assert all(l["code"] == "UNAVAILABLE" for l in redirected) and plain == {"echo-v1": 5} and not nacks


def _version_service(version: str) -> str:
    return (f"apiVersion: v1\nkind: Service\nmetadata: {{name: echo-{version}, namespace: echo-ns}}\n"
            f"spec:\n  selector: {{app: echo, version: {version}}}\n"
            f"  ports: [{{name: grpc, port: {SERVICE_PORT}, targetPort: grpc}}]\n")


GRPC_ROUTE = f"""apiVersion: gateway.networking.k8s.io/v1
kind: GRPCRoute
metadata: {{name: echo-split, namespace: echo-ns}}
spec:
  parentRefs: [{{group: "", kind: Service, name: echo, port: {SERVICE_PORT}}}]
  rules:
  - backendRefs:
    - {{name: echo-v1, port: {SERVICE_PORT}, weight: 70}}
    - {{name: echo-v2, port: {SERVICE_PORT}, weight: 30}}
"""


def test_a_weighted_grpc_route_on_the_service_splits_the_calls(versioned_mesh: Path,
                                                               start_istiod: Callable[..., Istiod],
                                                               start_demo: Callable[..., Process]) -> None:
    """GAMMA: a GRPCRoute whose parent is Service echo (port 7070) is the route of calls to echo,
    translated as a VirtualService's; echo-v1 and echo-v2 are Services of their own."""
    for version in ("v1", "v2"):
        (versioned_mesh / f"svc-{version}.yaml").write_text(_version_service(version))
    (versioned_mesh / "grpcroute.yaml").write_text(GRPC_ROUTE)
    istiod = start_istiod(versioned_mesh)
    n, p = 1000, 0.7
    client = start_demo("client", TARGET, "--xds", istiod.xds_address, "--count", str(n), "--interval", "0",
                        "--timeout", "5", "--namespace", "echo-ns", name="client")
    seen = outcomes(client, n)
    sd = math.sqrt(n * p * (1 - p))
    print(f"GRPCRoute 70/30 over {n} proxyless calls: {dict(seen)}; v1 {(seen['echo-v1'] - p * n) / sd:+.2f} sd")
    assert set(seen) == {"echo-v1", "echo-v2"} and abs(seen["echo-v1"] - p * n) <= 5 * sd, seen

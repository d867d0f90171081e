"""The load benchmark (bench/) still works and its clients are right.

A tiny run against a real istiod it starts itself, on the config dir and on a real kube-apiserver,
checks what the clients got, never how fast: every client configured, every change held, with the
compiled generator (bench/loadgen-go, built by its script when Go is there) and the Python one. The
Python generator's Envoy-like clients (SotW and delta) must hold what a real Envoy holds, and the
compiled one's exactly what the Python one's hold. Its /proc measures are checked on processes of
known CPU and memory.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2

from e2e.harness import BIN
from tests.conftest import synced
from tests.envoy_peer import node_id, sidecar_envoy
from tests.peers import Istiod, eventually, wait_until
from tests.pods import netns, requires_root
from tests.test_envoy_delta import KINDS, _config
from tests.test_ztunnel import TOKEN as ZTUNNEL_TOKEN
from tests.test_ztunnel import Mesh, _names, start_istiod
from tests.ztunnel_peer import Ztunnel, ztunnel_binary

BENCH = Path(__file__).parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import load  # noqa: E402
import procstat  # noqa: E402
import loadgen  # noqa: E402
from mesh import ConfigDirMesh, service_name  # noqa: E402

TINY = ["-S", "6", "-P", "1", "-N", "4", "-K", "2", "--envoy", "2", "--rate", "5", "--duration", "1",
        "--steady", "0.5", "--grace", "2", "--rest", "0.5", "--storm-timeout", "30"]
ZTUNNELS = ["-N", "0", "--envoy", "0", "--ztunnel", "3"]
TYPES = {"listeners": loadgen.LDS, "clusters": loadgen.CDS, "routes": loadgen.RDS, "endpoints": loadgen.EDS}


@pytest.fixture(scope="module")
def go_generator() -> Path:
    """The compiled load generator, built by its script (or copied from the machine's cache) as the
    e2e binaries are; the script is a no-op when it is up to date."""
    if shutil.which("go") is not None:
        build = subprocess.run(["bash", str(BENCH / "loadgen-go" / "build.sh")], capture_output=True, text=True,
                               timeout=900)
        assert build.returncode == 0, build.stderr
    elif not load.GO_GENERATOR.exists():
        pytest.skip("needs Go on PATH to build the compiled load generator (bench/loadgen-go/build.sh)")
    return load.GO_GENERATOR


@pytest.fixture(params=["go", "python"])
def generator(request: pytest.FixtureRequest) -> str:
    if request.param == "go":
        request.getfixturevalue("go_generator")
    return str(request.param)


def tiny_run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    run = subprocess.run([sys.executable, str(BENCH / "load.py"), *TINY, *extra, "--results", str(tmp_path)],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "| endpoint churn" in run.stdout
    [result_file] = tmp_path.glob("load-*.json")
    result: dict[str, Any] = json.loads(result_file.read_text())
    assert result["storm"]["all_configured"] and result["storm"]["not_configured"] == 0
    assert result["churn"]["changes"] == 5 and result["churn"]["never_seen"] == 0
    assert result["churn"]["latency"]["count"] > 0
    assert result["everyone"]["all_seen"] and result["everyone"]["never_seen"] == 0
    # The Envoy-like clients all end holding the same, and so do the ztunnels.
    assert result["envoy_final_states"] == (1 if result["size"]["envoy"] else None)
    assert result["ztunnel_final_states"] == (1 if result["size"]["ztunnel"] else None)
    # The clients' count of what istiod sent during the churn agrees with istiod's own metrics
    # (which count the resources, without the responses' envelopes).
    churn = result["churn"]
    assert churn["responses"] == churn["server_responses"] > 0
    assert 0 < churn["server_bytes_per_change"] <= churn["bytes_per_change"]
    assert result["memory_final"]["peak_rss_mb"] >= result["memory_final"]["rss_mb"] > 0
    return result


def test_tiny_run_on_the_config_dir_with_delta_clients(tmp_path: Path, generator: str) -> None:
    result = tiny_run(tmp_path, "--delta", "--generator", generator)
    assert result["size"]["generator"] == generator


def test_tiny_run_on_the_config_dir_with_sotw_clients_of_the_compiled_generator(tmp_path: Path,
                                                                                go_generator: Path) -> None:
    tiny_run(tmp_path, "--generator", "go")


@pytest.mark.skipif(not (BIN / "kube-apiserver").exists(), reason="needs the e2e binaries: make e2e-bin")
def test_tiny_run_through_a_kube_apiserver(tmp_path: Path, generator: str) -> None:
    result = tiny_run(tmp_path, "--source", "kube", "--generator", generator)
    assert result["churn"]["api_cpu_s"] > 0


def test_tiny_run_with_ztunnel_clients_on_the_config_dir(tmp_path: Path, generator: str) -> None:
    """ztunnels on the secure port, an ambient mesh: every pod IP change held by every ztunnel."""
    result = tiny_run(tmp_path, *ZTUNNELS, "--generator", generator)
    assert result["size"]["nodes"] == 3


@pytest.mark.skipif(not (BIN / "kube-apiserver").exists(), reason="needs the e2e binaries: make e2e-bin")
def test_tiny_run_with_ztunnel_clients_through_a_kube_apiserver(tmp_path: Path, generator: str) -> None:
    """The ambient mesh as Pods, Nodes and labelled Namespaces; a change is a pod's status."""
    result = tiny_run(tmp_path, *ZTUNNELS, "--source", "kube", "--generator", generator)
    assert result["churn"]["api_cpu_s"] > 0


def test_ztunnel_clients_with_sidecars_through_a_kube_apiserver_are_refused(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(BENCH / "load.py"), "--ztunnel", "2", "--source", "kube",
                          "--results", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "writes Pods, not EndpointSlices" in run.stderr


@pytest.mark.skipif(not (BIN / "kube-apiserver").exists(), reason="needs the e2e binaries: make e2e-bin")
def test_sigterm_mid_run_stops_every_process_the_bench_started(tmp_path: Path, generator: str) -> None:
    bench = subprocess.Popen([sys.executable, str(BENCH / "load.py"), *TINY, "--source", "kube", "--steady", "60",
                              "--generator", generator, "--workers", "2", "--results", str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert bench.stdout is not None
        for line in bench.stdout:
            if line.startswith("steady:"):
                break
        started = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in procstat.ProcessTree(bench.pid).pids()}
        names = {cmdline.split(b"\0")[0].rsplit(b"/", 1)[-1] for cmdline in started.values()}
        assert {b"etcd", b"kube-apiserver"} | ({b"loadgen"} if generator == "go" else set()) <= names, names
        assert len(started) >= 6  # the bench, etcd, kube-apiserver, istiod, two load generator workers
        bench.terminate()
        assert bench.wait(60) != 0
    finally:
        bench.kill()
        bench.wait()

    def left() -> list[bytes]:
        return [cmdline for pid, cmdline in started.items() if Path(f"/proc/{pid}/cmdline").exists()
                and Path(f"/proc/{pid}/cmdline").read_bytes() == cmdline]

    # multiprocessing's resource tracker leaves by itself once the bench is gone: a moment later.
    try:
        wait_until(lambda: not left(), 10, "every process the bench started to be gone")
    except AssertionError:
        raise AssertionError(f"still running: {left()}") from None


def test_an_envoy_like_client_holds_a_change_once_a_route_names_its_cluster() -> None:
    """As Envoy needs a route to a new Service's cluster besides its cluster and endpoints; a proxyless
    client (whose route came first) holds it with its endpoints. Configured likewise."""
    cluster = "outbound|7070||svc0.ns0.svc.cluster.local"
    envoy = loadgen.Client(loadgen.ClientSpec(0, "envoy", [], 1), loadgen.base_pb2.Node())
    envoy.subscribe(loadgen.EDS, {cluster})
    envoy.resources[loadgen.EDS][cluster] = (b"", {5})
    envoy.answered.add(loadgen.EDS)
    envoy.held_marks(cluster, {5}, 1.0)
    assert envoy.seen == {} and not envoy.configured()
    envoy.subscribe(loadgen.RDS, {"7070"})
    envoy.resources[loadgen.RDS]["7070"] = (b"", {cluster})
    envoy.answered.add(loadgen.RDS)
    envoy.route_to({cluster}, 2.0)
    assert envoy.seen == {5: 2.0} and envoy.configured()
    proxyless = loadgen.Client(loadgen.ClientSpec(1, "proxyless", ["svc0.ns0.svc.cluster.local:7070"], 1),
                               loadgen.base_pb2.Node())
    proxyless.held_marks(cluster, {5}, 1.0)
    assert proxyless.seen == {5: 1.0}


def test_process_tree_measures_a_child_and_its_grandchild() -> None:
    """Each of the two burns 0.3 s of its own CPU and holds 60 MB, then waits to be measured."""
    burn = ("import sys, time\nheld = bytearray(60 << 20)\n"
            "while time.process_time() < 0.3: pass\nprint('ready', flush=True)\nsys.stdin.read()\n")
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys\nchild = subprocess.Popen([sys.executable, '-c', {burn!r}], "
                               f"stdin=subprocess.PIPE, stdout=sys.stdout)\nexec({burn!r})"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        assert [parent.stdout.readline() for _ in range(2)] == ["ready\n"] * 2
        tree = procstat.ProcessTree(parent.pid)
        assert len(tree.pids()) == 2
        assert tree.cpu_seconds() >= 0.6 - 4 * 0.01  # /proc counts whole clock ticks: utime, stime of each
        memory = tree.memory_mb()
        assert memory["peak_rss_mb"] >= memory["rss_mb"] >= 120
    finally:
        parent.kill()
        parent.wait()


def held(client: loadgen.Client) -> dict[str, dict[str, bytes]]:
    return {kind: {name: value for name, (value, _) in client.resources[type_url].items()}
            for kind, type_url in TYPES.items()}


def addresses(held_endpoints: dict[str, bytes]) -> dict[str, set[str]]:
    """Cluster -> its endpoints' addresses, from serialized ClusterLoadAssignments."""
    result = {}
    for name, value in held_endpoints.items():
        assignment = endpoint_pb2.ClusterLoadAssignment.FromString(value)
        result[name] = {e.endpoint.address.socket_address.address for locality in assignment.endpoints
                        for e in locality.lb_endpoints}
    return result


def envoy_config(envoy: Any) -> dict[str, dict[str, Any]] | None:
    try:
        return _config(envoy)
    except KeyError:  # a kind Envoy holds none of yet is missing from its dump
        return None


def envoy_addresses(config: dict[str, dict[str, Any]]) -> dict[str, set[str]]:
    return {name: {e["endpoint"]["address"]["socket_address"]["address"] for locality in c.get("endpoints", [])
                   for e in locality.get("lb_endpoints", [])} for name, c in config["endpoints"].items()}


@dataclass
class EnvoyLike:
    mesh: ConfigDirMesh
    istiod: Istiod
    worker: loadgen.Worker  # a SotW and a delta Envoy-like client, running

    def change(self) -> None:
        """An endpoint moves (mark 7), a Service comes (mark 8), one goes (removed_resources, EDS unsubscribed)."""
        self.mesh.change(0, 7)
        self.mesh.add(4, 2, 8)
        (self.mesh.root / f"{service_name(1)[0]}.yaml").unlink()


@pytest.fixture
async def envoy_like(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> AsyncIterator[EnvoyLike]:
    """Services 0-3 in a config dir, an istiod on it, and the Python generator's Envoy-like clients."""
    mesh = ConfigDirMesh(mesh_dir, pods=2)
    mesh.create(4)
    istiod = start_istiod(mesh_dir)
    worker = loadgen.Worker(istiod.xds_address, [loadgen.ClientSpec(0, "envoy", [], 4),
                                                 loadgen.ClientSpec(1, "delta", [], 4)])
    stop = asyncio.Event()
    tasks = [asyncio.create_task(worker.run_client(client, stop)) for client in worker.clients]
    try:
        yield EnvoyLike(mesh, istiod, worker)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def services(state: dict[str, dict[str, bytes]]) -> set[int]:
    return {s for s in range(5) if f"outbound|7070||{'.'.join(service_name(s))}.svc.cluster.local" in state["clusters"]}


async def test_envoy_like_clients_sotw_and_delta_hold_what_a_real_envoy_holds(envoy_like: EnvoyLike) -> None:
    istiod, worker = envoy_like.istiod, envoy_like.worker
    sotw, delta = worker.clients

    async def agree(envoy: Any, want: set[int], what: str) -> dict[str, dict[str, bytes]]:
        """Services `want` held; the delta client holds exactly what the SotW one does, and the
        same names and endpoints as Envoy."""
        def check() -> dict[str, dict[str, bytes]] | None:
            config = envoy_config(envoy)
            ours = held(sotw)
            if config is None or held(delta) != ours or services(ours) != want:
                return None
            # Envoy dumps the load assignments of static clusters too; a client asks EDS for EDS clusters only.
            config["endpoints"] = {n: e for n, e in config["endpoints"].items() if config["clusters"][n].get("type") == "EDS"}
            if {k: set(ours[k]) for k in KINDS} != {k: set(config[k]) for k in KINDS}:
                return None
            return ours if addresses(ours["endpoints"]) == envoy_addresses(config) else None

        try:
            return await eventually(check, 20, what)
        except AssertionError:
            config = envoy_config(envoy)
            envoy_names = {k: sorted(config[k]) for k in KINDS} if config else "warming"
            raise AssertionError(f"{what}: sotw {summary(held(sotw))}\ndelta {summary(held(delta))}\n"
                                 f"envoy {envoy_names}") from None

    with sidecar_envoy(istiod.xds_address, "client9", "bench", ip="10.250.0.9") as envoy:
        await agree(envoy, {0, 1, 2, 3}, "the first config everywhere")
        await eventually(lambda: all(synced(istiod, node_id(f"client{i}", "bench", f"10.250.0.{i}"),
                                            ("cluster", "listener", "endpoint", "route")) for i in (0, 1)),
                         10, "istiod to see every type ACKed by both load clients")

        envoy_like.change()
        changed = await agree(envoy, {0, 2, 3, 4}, "the changes everywhere")
        assert not any("svc1." in n for n in changed["endpoints"])
        endpoints = addresses(changed["endpoints"])
        assert endpoints["outbound|7070||svc0.ns0.svc.cluster.local"] == {loadgen.mark_address(7), "10.0.0.2"}
        assert {7, 8} <= set(delta.seen) and {7, 8} <= set(sotw.seen)
        assert not any(sum(c.streams_failed.values()) for c in worker.clients)


def summary(state: dict[str, dict[str, bytes]]) -> dict[str, list[str]]:
    return {kind: sorted(names) for kind, names in state.items()}


async def test_compiled_envoy_like_clients_end_holding_what_the_python_ones_hold(
    envoy_like: EnvoyLike, go_generator: Path
) -> None:
    """SotW and delta, in both generators: after the same changes, byte for byte the same digest."""
    worker = envoy_like.worker
    compiled = load.GoGenerator(envoy_like.istiod.xds_address, [[loadgen.ClientSpec(2, "envoy", [], 4),
                                                                 loadgen.ClientSpec(3, "delta", [], 4)]])
    messages: list[tuple[str, Any]] = []

    async def told(kind: str, value: Any = None) -> Any:
        """The compiled generator's message of `kind` (and `value`), in whichever order they come."""
        while not (found := [v for k, v in messages if k == kind and value in (None, v)]):
            messages.append(await asyncio.to_thread(compiled.control.get, timeout=30))
        return found[0]

    def python_state(marks: set[int]) -> str | None:
        """The Python clients' one digest, once both hold `marks` and services 0, 2, 3, 4 only."""
        sotw, delta = worker.clients
        states = {sotw.digest(), delta.digest()}
        final = services(held(sotw)) == {0, 2, 3, 4} and marks <= set(sotw.seen) & set(delta.seen)
        return states.pop() if len(states) == 1 and final else None

    try:
        compiled.start()
        await told("ready")
        compiled.go()
        await told("configured")
        envoy_like.change()
        await eventually(lambda: python_state({7, 8}), 20, "the Python clients to hold the changes")
        # A last change, after the others are everywhere: once the compiled clients hold it, they
        # were sent all before it.
        envoy_like.mesh.change(2, 9)
        for mark in (7, 8, 9):
            await told("all-seen", mark)
        state = await eventually(lambda: python_state({9}), 20, "the Python clients to hold the last change")
        compiled.finish()
        report = await told("summary")
        assert [(c["kind"], c["state"]) for c in report["clients"]] == [("envoy", state), ("delta", state)]
        assert all(c["settled"] and not c["streams_failed"] and {7, 8, 9} <= set(c["seen"]) for c in report["clients"])
    finally:
        compiled.stop()


@requires_root
def test_compiled_ztunnel_client_holds_what_a_real_ztunnel_holds(tmp_path: Path, go_generator: Path) -> None:
    """The ambient test mesh, one istiod, a real ztunnel and the compiled generator's ztunnel client
    side by side (in one network namespace: ztunnel's ports are fixed): the client holds the Addresses
    and Authorizations that the real ztunnel's /config_dump shows, before and after a pod comes with
    a marked IP, which the client sees as its change."""
    binary = ztunnel_binary()
    with netns("ztbench") as pod:
        mesh = Mesh(tmp_path / "config")
        istiod = start_istiod(pod, tmp_path, mesh.root)
        ztunnel, compiled = None, None
        try:
            ztunnel = Ztunnel(binary, pod, tmp_path / "zt", {
                "XDS_ADDRESS": "https://127.0.0.1:15012", "XDS_ROOT_CA": str(tmp_path / "state" / "root-cert.pem"),
                "AUTH_TOKEN": ZTUNNEL_TOKEN, "PROXY_WORKLOAD_INFO": "ambient/echo-1/echo", "POD_NAME": "ztunnel-0",
                "POD_NAMESPACE": "istio-system", "INSTANCE_IP": "10.244.0.11", "NODE_NAME": "node-a"})
            ztunnel.wait_ready()
            state = tmp_path / "state"
            secure = load.ztunnel_identity(state / "istio-ca-secret", state / "root-cert.pem", "127.0.0.1:15012")
            compiled = load.GoGenerator("127.0.0.1:15010", [[loadgen.ClientSpec(0, "ztunnel", [], 11, "node-a",
                                                                                 report_held=True)]],
                                        secure, tuple(pod.exec_args()))
            compiled.start()
            messages: list[tuple[str, Any]] = []

            def told(kind: str, value: Any = None) -> Any:
                while not (found := [v for k, v in messages if k == kind and value in (None, v)]):
                    messages.append(compiled.control.get(timeout=30))
                return found[0]

            told("ready")
            compiled.go()
            told("configured")
            arrived = mesh.get("Pod", "ambient", "echo-1")
            arrived["metadata"]["name"], arrived["status"]["podIP"] = "echo-4", loadgen.mark_address(7)
            mesh.put(arrived)
            told("all-seen", 7)
            wait_until(lambda: "Kubernetes//Pod/ambient/echo-4" in _names(ztunnel.config_dump())[0], 10,
                       "the real ztunnel to hold the new pod", 0.1)
            workloads, services, policies = _names(ztunnel.config_dump())
            compiled.finish()
            [client] = told("summary")["clients"]
            assert client["settled"] and not client["streams_failed"]
            assert set(client["held"][loadgen.ADDRESS]) == workloads | services
            assert set(client["held"][loadgen.AUTHORIZATION]) == policies
        finally:
            if compiled is not None:
                compiled.stop()
            if ztunnel is not None:
                ztunnel.stop()
            istiod.stop()

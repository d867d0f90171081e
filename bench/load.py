"""Load benchmark: many xDS clients against one istiod, the mesh and its changes in a config dir
or in a real kube-apiserver.

    python bench/load.py [--services S] [--pods P] [--proxyless N] [--watch K] [--rate R]
                         [--duration SECONDS] [--envoy M] [--delta] [--ztunnel Z [--nodes NODES]]
                         [--source config|kube]
                         [--generator go|python] [--xds-addr HOST:PORT --config-dir DIR]

The defaults (200 Services, 400 proxyless clients) take about a minute; a large mesh, 2000 clients:
--services 1000 --pods 2 --proxyless 2000 --watch 5 --rate 10 --duration 30 (a few minutes).
Ambient (ztunnel clients, the mesh an ambient cluster's: see mesh.py): --services 1000 --pods 5
--proxyless 0 --ztunnel 50 --rate 10 --duration 30 --source kube; a change is then a pod's IP,
and ztunnels reach istiod's secure port with a workload certificate of its CA (plugged in here).
Scenarios, in order: connect storm (time until every client is configured), steady state (server
CPU while nothing changes), endpoint churn (R pod address changes a second; per change the time
from the write to each watching client holding it), and a new Service every client watches.
`--source config` (the default): without --xds-addr an istiod is started on a fresh config dir;
with it, the mesh is written to --config-dir (the one that istiod watches) and --server-pid names
the process to measure. `--source kube`: etcd and kube-apiserver are started (the e2e harness),
the Services, their Pods and EndpointSlices created through the API, and istiod started in kube
mode; a change is a pod's IP (its status, then its EndpointSlice), timed from the slice's request.
The clients run in the compiled generator (bench/loadgen-go, built by its build.sh) once it is built,
else in Python worker processes (bench/loadgen.py); the same clients either way.
Every process started here is stopped at the end, on failure, Ctrl-C or SIGTERM too.
Writes results/load-<time>.json and .png (the plot needs the `bench` extra), prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # the e2e harness and the tests' process helpers
import loadgen  # noqa: E402  # a sibling script, importable in the spawned workers too
from mesh import ConfigDirMesh, KubeMesh, listener, node_name  # noqa: E402
from procstat import ProcessTree  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tests.peers import stop_group  # noqa: E402
from tests.pki import leaf_cert, write_plugged  # noqa: E402

Mesh = ConfigDirMesh | KubeMesh

EVERYONE_MARK = (1 << 22) - 1  # the new Service's pod's marked address, past any churn change's
# The compiled load generator, built by bench/loadgen-go/build.sh (`make bench` does).
GO_GENERATOR = Path(__file__).resolve().parent.parent / ".cache" / "bench-bin" / "loadgen"
# Services' ClusterIPs when the mesh is in a kube-apiserver: room for 65k, apart from the pods' 10.0-10.95.
SERVICE_CIDR = "10.96.0.0/16"


class Server:
    """The istiod under test: started here on the mesh's source, or an outside one measured by its pid."""

    def __init__(self, source_args: list[str], workdir: Path, xds_addr: str | None, pid: int | None) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_url: str | None = None
        self.secure: loadgen.Secure | None = None
        self.secure_addr: str | None = None
        if xds_addr:
            self.xds_addr, self.tree = xds_addr, ProcessTree(pid) if pid else None
            return
        ports = workdir / "ports.json"
        with open(workdir / "istiod.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "istiod", "discovery", *source_args,
                 "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--monitoring-addr", "127.0.0.1:0",
                 "--secure-grpc-addr", "127.0.0.1:0", "--webhook-addr", "127.0.0.1:0",
                 "--ca-state-dir", str(workdir / "state"), "--ports-file", str(ports)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.tree = ProcessTree(self.proc.pid)
        deadline = time.monotonic() + 120
        try:
            while True:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = (workdir / "istiod.log").read_text(errors="replace").splitlines()[-20:]
                    raise SystemExit("istiod did not start; its log ends:\n" + "\n".join(tail))
                try:
                    port = json.loads(ports.read_text())
                    with urllib.request.urlopen(f"http://127.0.0.1:{port['http']}/ready", timeout=2):
                        break
                except (OSError, ValueError, KeyError):
                    time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        self.xds_addr = f"127.0.0.1:{port['grpc']}"
        self.metrics_url = f"http://127.0.0.1:{port['monitoring']}/metrics"
        self.secure_addr = f"127.0.0.1:{port['secure-grpc']}"

    def sent(self) -> tuple[float, float] | None:
        """(resource bytes, responses) istiod says it has sent so far, from its own metrics."""
        if not self.metrics_url:
            return None
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        sizes = [f for f in text_string_to_metric_families(text) if f.name == "pilot_xds_config_size_bytes"]
        samples = [s for f in sizes for s in f.samples]
        return (sum(s.value for s in samples if s.name.endswith("_sum")),
                sum(s.value for s in samples if s.name.endswith("_count")))

    def cpu_seconds(self) -> float | None:
        return self.tree.cpu_seconds() if self.tree else None

    def memory_mb(self) -> dict[str, float] | None:
        return self.tree.memory_mb() if self.tree else None

    def stop(self) -> None:
        if self.proc:
            stop_group(self.proc, grace=10)


def reference_server(binary: str, mesh: Mesh, workdir: Path, stack: contextlib.ExitStack) -> Server:
    """Istio's own istiod on the mesh's kube-apiserver (with Istio's CRDs), measured as ours is. Its
    plaintext port authenticates nobody: ztunnel clients use it (no certificate of its CA here)."""
    from e2e.istio_crds import install_crds
    from reference import start_reference

    assert isinstance(mesh, KubeMesh)
    mesh.run(install_crds(mesh.api), 60)
    proc, xds_addr, metrics_url = start_reference(binary, mesh.kubeconfig, workdir)
    stack.callback(stop_group, proc, 10)
    server = Server([], workdir, xds_addr, proc.pid)
    server.metrics_url = metrics_url
    return server


def plugged_ca(workdir: Path) -> list[str]:
    """A CA of our own plugged into istiod, so that the bench can give ztunnel clients a workload
    certificate of it (what istio-agent's CSR would get) and they connect as a real ztunnel does."""
    write_plugged(workdir / "ca", "bench")
    return ["--plugged-ca-dir", str(workdir / "ca"), "--tls-extra-san", "127.0.0.1"]


def ztunnel_identity(ca: Path, root: Path, secure_addr: str) -> loadgen.Secure:
    """Istio's ztunnel identity (istio-system/ztunnel), signed by the CA in `ca` (ca-cert.pem,
    ca-key.pem) that chains to `root`; written beside them."""
    from cryptography import x509

    from istiod.ca.pki import cert_pem, key_pem, load_key, new_key

    issuer = (x509.load_pem_x509_certificate((ca / "ca-cert.pem").read_bytes()),
              load_key((ca / "ca-key.pem").read_bytes(), "the bench's CA key"))
    key = new_key()
    cert = leaf_cert(key, issuer, uris=("spiffe://cluster.local/ns/istio-system/sa/ztunnel",))
    (ca / "ztunnel-cert.pem").write_text(cert_pem(cert) + (ca / "ca-cert.pem").read_text())
    (ca / "ztunnel-key.pem").write_bytes(key_pem(key))
    return loadgen.Secure(secure_addr, str(root), str(ca / "ztunnel-cert.pem"), str(ca / "ztunnel-key.pem"))


def workload_identities(ca: Path, clients: int, secure_addr: str) -> loadgen.Secure:
    """For `--tls`: a workload certificate for every client (`bench/client<i>`, the namespace its node
    metadata names), signed by the CA in `ca` as the CSR of each client's agent would get it. They
    share one key: the handshake costs istiod the same, and minting stays cheap."""
    from cryptography import x509

    from istiod.ca.pki import cert_pem, key_pem, load_key, new_key

    issuer = (x509.load_pem_x509_certificate((ca / "ca-cert.pem").read_bytes()),
              load_key((ca / "ca-key.pem").read_bytes(), "the bench's CA key"))
    key, chain = new_key(), (ca / "ca-cert.pem").read_text()
    (ca / "clients").mkdir()
    for index in range(clients):
        cert = leaf_cert(key, issuer, uris=(f"spiffe://cluster.local/ns/bench/sa/client{index}",))
        (ca / "clients" / f"{index}.pem").write_text(cert_pem(cert) + chain)
    (ca / "clients" / "key.pem").write_bytes(key_pem(key))
    return loadgen.Secure(secure_addr, str(ca / "root-cert.pem"), str(ca / "clients" / "{index}.pem"),
                          str(ca / "clients" / "key.pem"), all_clients=True)


class PythonGenerator:
    """The clients in worker processes running bench/loadgen.py."""

    def __init__(self, xds_addr: str, shares: list[list[loadgen.ClientSpec]], secure: loadgen.Secure | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.control: Any = ctx.Queue()
        self._go, self._stop = ctx.Event(), ctx.Event()
        self.processes = [ctx.Process(target=loadgen.main,
                                      args=(xds_addr, share, self.control, self._go, self._stop, secure),
                                      daemon=True) for share in shares]

    def start(self) -> None:
        for process in self.processes:
            process.start()

    def go(self) -> None:
        self._go.set()

    def finish(self) -> None:
        """The clients settle, then each worker puts its summary on `control`."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        for process in self.processes:
            if process.pid is not None:
                process.join(30)
                if process.is_alive():
                    process.kill()
                    process.join()


class GoGenerator:
    """The same clients in processes of the compiled generator (bench/loadgen-go), whose JSON lines
    become the (kind, value) messages that the Python workers put on `control`."""

    def __init__(self, xds_addr: str, shares: list[list[loadgen.ClientSpec]], secure: loadgen.Secure | None = None,
                 command: tuple[str, ...] = ()) -> None:
        """`command`: what runs the generator (its path is appended), e.g. a network namespace's exec."""
        self.control: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.xds_addr, self.shares, self.secure, self.command = xds_addr, shares, secure, command
        self.processes: list[subprocess.Popen[str]] = []

    def start(self) -> None:
        for share in self.shares:
            process = subprocess.Popen([*self.command, str(GO_GENERATOR)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
            self.processes.append(process)
            self._tell(process, json.dumps({"xds_addr": self.xds_addr, "settle_seconds": loadgen.SETTLE_SECONDS,
                                            "ticks": loadgen.TICKS, "clients": [dataclasses.asdict(s) for s in share],
                                            "secure": dataclasses.asdict(self.secure) if self.secure else None}))
            threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            kind, value = json.loads(line)
            if kind == "summary":
                for client in value["clients"]:  # JSON's keys are strings; the marks are numbers
                    client["seen"] = {int(mark): when for mark, when in client["seen"].items()}
            self.control.put((kind, value))

    @staticmethod
    def _tell(process: subprocess.Popen[str], line: str) -> None:
        assert process.stdin is not None
        with contextlib.suppress(OSError):  # it is gone already: its end is seen by whoever waits on it
            process.stdin.write(line + "\n")
            process.stdin.flush()

    def go(self) -> None:
        for process in self.processes:
            self._tell(process, "go")

    def finish(self) -> None:
        for process in self.processes:
            self._tell(process, "stop")

    def stop(self) -> None:
        """The end of its input stops a generator at once."""
        for process in self.processes:
            assert process.stdin is not None
            with contextlib.suppress(OSError):
                process.stdin.close()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"count": len(values), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


def client_specs(args: argparse.Namespace) -> list[loadgen.ClientSpec]:
    rng = random.Random(1)
    specs = []
    for i in range(args.proxyless):
        watched = rng.sample(range(args.services), min(args.watch, args.services))
        specs.append(loadgen.ClientSpec(i, "proxyless", [listener(s) for s in watched] + [listener(-1)], len(watched)))
    for i in range(args.envoy):
        specs.append(loadgen.ClientSpec(args.proxyless + i, "delta" if args.delta else "envoy", [], args.services))
    for i in range(args.ztunnel):  # one a node; every ztunnel holds every Service and pod
        specs.append(loadgen.ClientSpec(args.proxyless + args.envoy + i, "ztunnel", [], args.services * (1 + args.pods),
                                        node_name(i % args.nodes)))
    return specs


def watched_services(spec: loadgen.ClientSpec, services: int) -> set[str]:
    if spec.kind == "proxyless":
        return set(spec.listeners)
    return {listener(s) for s in range(services)}


def open_mesh(args: argparse.Namespace, workdir: Path, stack: contextlib.ExitStack) -> tuple[Mesh, ProcessTree | None]:
    """Where the mesh lives, and the processes that serve it (the API server and etcd) if any;
    whatever is started is stopped by `stack`, even on failure."""
    if args.source == "config":
        root = args.config_dir or workdir / "mesh"
        root.mkdir(exist_ok=True)
        return ConfigDirMesh(root, args.pods, args.nodes), None
    from e2e.harness import Cluster  # only the kube source needs the e2e binaries

    (workdir / "cluster").mkdir()
    try:
        cluster = Cluster(workdir / "cluster", service_cidr=SERVICE_CIDR)
    except RuntimeError as error:  # the binaries are missing: says how to build them
        raise SystemExit(str(error)) from None
    stack.callback(cluster.stop)
    print("kube: starting etcd and kube-apiserver", flush=True)
    cluster.start()
    mesh = KubeMesh(cluster.kubeconfig, args.pods, args.nodes)
    stack.callback(mesh.close)
    assert cluster.etcd.proc and cluster.apiserver.daemon.proc
    return mesh, ProcessTree(cluster.etcd.proc.pid, cluster.apiserver.daemon.proc.pid)


def run(args: argparse.Namespace, workdir: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    result: dict[str, Any] = {"size": {k: v for k, v in vars(args).items() if k not in ("xds_addr", "config_dir", "results")}}
    mesh, api = open_mesh(args, workdir, stack)
    started = time.monotonic()
    mesh.create(args.services)
    result["mesh_create_s"] = time.monotonic() - started
    print(f"mesh: {args.services} Services x {args.pods} pods ({args.source}) written in {result['mesh_create_s']:.1f} s",
          flush=True)
    if args.reference_istiod:
        server = reference_server(args.reference_istiod, mesh, workdir, stack)
    else:
        ca = plugged_ca(workdir) if args.ztunnel or args.tls else []
        server = Server([*mesh.source_args(), *ca, *args.istiod_arg], workdir, args.xds_addr, args.server_pid)
        stack.callback(server.stop)
    specs = client_specs(args)
    if server.secure_addr is not None and args.tls:
        server.secure = workload_identities(workdir / "ca", len(specs), server.secure_addr)
    elif server.secure_addr is not None and args.ztunnel:
        server.secure = ztunnel_identity(workdir / "ca", workdir / "ca" / "root-cert.pem", server.secure_addr)
    generator_type = GoGenerator if args.generator == "go" else PythonGenerator
    generator = generator_type(server.xds_addr, [specs[w::args.workers] for w in range(args.workers)], server.secure)
    control = generator.control
    events: list[tuple[str, Any]] = []

    def wait_for(kind: str, count: int, timeout: float, value: Any = None) -> bool:
        deadline = time.monotonic() + timeout
        while sum(1 for k, v in events if k == kind and (value is None or v == value)) < count:
            try:
                events.append(control.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                return False
        return True

    stack.callback(generator.stop)
    generator.start()
    if not wait_for("ready", args.workers, 60):
        raise SystemExit("the load generator's workers did not start")
    result["memory_before"] = server.memory_mb()  # what it returns to at rest, once the clients are served
    cpu0 = server.cpu_seconds()
    started = time.time()
    generator.go()
    print(f"storm: {len(specs)} clients in {args.workers} {args.generator} processes against {server.xds_addr}", flush=True)
    all_configured = wait_for("configured", args.workers, args.storm_timeout)
    storm_cpu = server.cpu_seconds()
    result["storm"] = {"all_configured": all_configured,
                       "seconds": max(v for k, v in events if k == "configured") - started if all_configured else None,
                       "server_cpu_s": storm_cpu - cpu0 if storm_cpu is not None and cpu0 is not None else None,
                       "memory": server.memory_mb()}

    time.sleep(2)  # past the storm's retries
    print(f"steady: {args.steady:.0f} s with no change", flush=True)
    cpu0, wall0 = server.cpu_seconds(), time.monotonic()
    time.sleep(args.steady)
    cpu1 = server.cpu_seconds()
    result["steady"] = {"server_cores": (cpu1 - cpu0) / (time.monotonic() - wall0) if cpu1 is not None and cpu0 is not None else None}

    print(f"churn: {args.rate} endpoint changes/s for {args.duration:.0f} s", flush=True)
    rng = random.Random(2)
    changed: dict[int, str] = {}  # change -> the changed service's listener
    cpu0, api_cpu0, sent0 = server.cpu_seconds(), api.cpu_seconds() if api else None, server.sent()
    churn_start = time.time()
    for change in range(int(args.rate * args.duration)):
        time.sleep(max(0.0, churn_start + change / args.rate - time.time()))
        s = rng.randrange(args.services)
        changed[change] = listener(s)
        mesh.change(s, change)
    churn_end = time.time()
    time.sleep(args.grace)
    cpu1 = server.cpu_seconds()
    churn_cpu = cpu1 - cpu0 if cpu1 is not None and cpu0 is not None else None
    api_cpu = api.cpu_seconds() - api_cpu0 if api and api_cpu0 is not None else None
    sent1 = server.sent()
    server_sent = [b - a for a, b in zip(sent0, sent1)] if sent0 and sent1 else [None, None]
    written = mesh.settle()
    writes = {change: (written[change], name) for change, name in changed.items()}

    print("every client's change: a new Service", flush=True)
    cpu0 = server.cpu_seconds()
    mesh.add(-1, 1, EVERYONE_MARK)
    everyone_seen = wait_for("all-seen", args.workers, args.storm_timeout, EVERYONE_MARK)
    cpu1 = server.cpu_seconds()
    everyone_written = mesh.settle()[EVERYONE_MARK]
    time.sleep(args.rest)
    result["memory_rest"] = server.memory_mb()  # every client still connected, the pushes over
    generator.finish()
    summaries: list[dict[str, Any]] = []
    while len(summaries) < args.workers:
        kind, value = control.get(timeout=60)
        events.append((kind, value))
        if kind == "summary":
            summaries.append(value)
    result["memory_final"] = server.memory_mb()

    clients = [c for summary in summaries for c in summary["clients"]]
    configured = [c["configured_at"] - started for c in clients if c["configured_at"]]
    result["storm"]["configured"] = percentiles(configured)
    result["storm"]["not_configured"] = len(clients) - len(configured)
    result["storm"]["tls_handshake"] = percentiles([s for summary in summaries for s in summary["handshakes"] or ()])
    failed: dict[str, int] = {}
    for c in clients:
        for code, n in c["streams_failed"].items():
            failed[code] = failed.get(code, 0) + n
    result["streams_failed"] = failed
    result["stream_failure_details"] = {k: v for summary in summaries for k, v in summary["failure_details"].items()}

    # A change counts as held once the client holds it or a later change of the same service.
    latencies, never = [], 0
    spec_by_index = {spec.index: spec for spec in specs}
    for c in clients:
        seen = c["seen"]
        watching = watched_services(spec_by_index[c["index"]], args.services)
        later: dict[str, float] = {}  # service -> the first time a change of it from here on was held
        for change in sorted(writes, reverse=True):
            when, name = writes[change]
            if name not in watching:
                continue
            if change in seen:
                later[name] = min(later.get(name, seen[change]), seen[change])
            if name in later:
                latencies.append(later[name] - when)
            else:
                never += 1
    # What the server sent all clients (xDS responses, serialized) from the first change to the end of the grace.
    window = [n for summary in summaries for tick, n in summary["traffic"].items()
              if churn_start <= int(tick) / loadgen.TICKS <= churn_end + args.grace]
    churn_bytes, churn_responses = sum(n[0] for n in window), sum(n[1] for n in window)
    result["churn"] = {"changes": len(writes), "latency": percentiles(latencies), "never_seen": never,
                       "server_cpu_s": churn_cpu, "api_cpu_s": api_cpu, "responses": churn_responses,
                       "bytes_per_change": churn_bytes / max(1, len(writes)),
                       "bytes_per_response": churn_bytes / max(1, churn_responses),
                       # istiod's count: resource bytes without the responses' envelopes
                       "server_bytes_per_change": server_sent[0] / max(1, len(writes)) if server_sent[0] is not None else None,
                       "server_responses": server_sent[1]}
    everyone = [c["seen"][EVERYONE_MARK] - everyone_written for c in clients if EVERYONE_MARK in c["seen"]]
    result["everyone"] = {"all_seen": everyone_seen, "latency": percentiles(everyone), "never_seen": len(clients) - len(everyone),
                          # until every client held it
                          "server_cpu_s": cpu1 - cpu0 if cpu1 is not None and cpu0 is not None else None}
    # Envoy-like clients all ask for everything: under load too, SotW or delta, they must end the same;
    # and so must ztunnels.
    envoy_states = {c["state"] for c in clients if c["kind"] in ("envoy", "delta")}
    result["envoy_final_states"] = len(envoy_states) if envoy_states else None
    ztunnel_states = {c["state"] for c in clients if c["kind"] == "ztunnel"}
    result["ztunnel_final_states"] = len(ztunnel_states) if ztunnel_states else None
    result["unsettled"] = sum(1 for c in clients if not c["settled"])
    result["generator_cpu_s"] = sum(summary["cpu_s"] for summary in summaries)
    result["raw"] = {"configured": configured, "churn": latencies, "everyone": everyone}
    return result


def table(result: dict[str, Any]) -> str:
    ms = lambda v: "-" if v is None else f"{v * 1e3:.0f} ms"  # noqa: E731
    num = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    rows = [("| scenario | p50 | p90 | p99 | max | other |"), "|---|---|---|---|---|---|"]
    for name, key, extra in (
        ("connect storm (to configured)", ("storm", "configured"),
         f"not configured {result['storm']['not_configured']}; streams failed {result['streams_failed'] or 0}; "
         f"server CPU {num(result['storm']['server_cpu_s'])} s"),
        ("endpoint churn (write to held)", ("churn", "latency"),
         f"{result['churn']['changes']} changes, never seen {result['churn']['never_seen']}; "
         f"{num(result['churn']['bytes_per_change'], '{:.0f}')} B/change in {result['churn']['responses']} responses "
         f"({num(result['churn']['bytes_per_response'], '{:.0f}')} B each); server CPU {num(result['churn']['server_cpu_s'])} s"
         + (f", API server + etcd CPU {num(result['churn']['api_cpu_s'])} s" if result['churn']['api_cpu_s'] is not None else "")
         + (f"; istiod counts {num(result['churn']['server_bytes_per_change'], '{:.0f}')} resource B/change in "
            f"{num(result['churn']['server_responses'], '{:.0f}')} responses"
            if result['churn']['server_bytes_per_change'] is not None else "")),
        ("new Service every client watches", ("everyone", "latency"), f"never seen {result['everyone']['never_seen']}; "
         f"server CPU {num(result['everyone']['server_cpu_s'])} s"
         + (f"; Envoy-like clients end in {result['envoy_final_states']} distinct state(s) (1: all the same)"
            if result["envoy_final_states"] else "")
         + (f"; ztunnels end in {result['ztunnel_final_states']} distinct state(s)"
            if result.get("ztunnel_final_states") else "")
         + f"; {result['unsettled']} client(s) still without all they asked for {loadgen.SETTLE_SECONDS} s later"),
    ):
        stats = result[key[0]][key[1]]
        rows.append(f"| {name} | {ms(stats['p50'])} | {ms(stats['p90'])} | {ms(stats['p99'])} | {ms(stats['max'])} | {extra} |")
    handshake = result["storm"].get("tls_handshake") or {}
    if handshake.get("count"):
        rows.append(f"| TLS handshake (the generator's) | {ms(handshake['p50'])} | {ms(handshake['p90'])} | "
                    f"{ms(handshake['p99'])} | {ms(handshake['max'])} | {handshake['count']} handshakes |")
    memory, before, rest = (result.get(k) or {} for k in ("memory_final", "memory_before", "memory_rest"))
    rows.append(f"| mesh written ({result['size']['source']}) | | | | | {result['mesh_create_s']:.1f} s |")
    rows.append(f"| steady state | | | | | server {num(result['steady']['server_cores'], '{:.3f}')} cores |")
    rows.append(f"| load generator | | | | | {num(result['generator_cpu_s'])} s CPU in all |")
    rows.append(f"| memory | | | | | RSS before the storm {num(before.get('rss_mb'), '{:.0f}')} MB, "
                f"peak {num(memory.get('peak_rss_mb'), '{:.0f}')} MB, at rest after the new Service "
                f"{num(rest.get('rss_mb'), '{:.0f}')} MB, final {num(memory.get('rss_mb'), '{:.0f}')} MB |")
    return "\n".join(rows)


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, values in (("connect storm: configured", result["raw"]["configured"]),
                          ("endpoint churn: write to held", result["raw"]["churn"]),
                          ("new Service: write to held", result["raw"]["everyone"])):
        if values:
            ordered = sorted(values)
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=f"{label} (n={len(values)})")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of clients (x changes)")
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    size = result["size"]
    ax.set_title(f"{size['source']}: S={size['services']} P={size['pods']} N={size['proxyless']} K={size['watch']} "
                 f"R={size['rate']} envoy={size['envoy']}{' delta' if size['delta'] else ''} ztunnel={size['ztunnel']}")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return True


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and each flag's default (those that have one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, [], argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--services", "-S", type=int, default=200, help="Services in the mesh")
    parser.add_argument("--pods", "-P", type=int, default=2, help="pods per service")
    parser.add_argument("--proxyless", "-N", type=int, default=400, help="proxyless gRPC clients")
    parser.add_argument("--watch", "-K", type=int, default=5, help="services each proxyless client watches")
    parser.add_argument("--rate", "-R", type=float, default=10, help="endpoint changes per second")
    parser.add_argument("--duration", type=float, default=20, help="seconds of churn")
    parser.add_argument("--envoy", type=int, default=0, help="Envoy-like clients (wildcard CDS/LDS)")
    parser.add_argument("--delta", action="store_true", help="Envoy-like clients use delta xDS")
    parser.add_argument("--ztunnel", type=int, default=0,
                        help="ztunnel clients (delta WDS on the secure port), one a node; makes the mesh ambient")
    parser.add_argument("--tls", action="store_true",
                        help="every client on the secure port (15012) with a workload certificate of its own from "
                             "a CA the bench plugs into istiod, as sidecars connect; the TLS handshakes are timed")
    parser.add_argument("--nodes", type=int, help="Nodes the ambient mesh's pods are spread over (default: --ztunnel)")
    parser.add_argument("--generator", choices=("go", "python"),
                        help="the load generator: compiled (go, the default once built by "
                             "bench/loadgen-go/build.sh) or Python processes")
    parser.add_argument("--workers", type=int, help="load generator processes (default: 1 for go, 2 for python)")
    parser.add_argument("--steady", type=float, default=5, help="seconds of steady state measured")
    parser.add_argument("--grace", type=float, default=10, help="seconds after churn for late deliveries")
    parser.add_argument("--rest", type=float, default=10,
                        help="seconds after every client holds the new Service until RSS at rest is read")
    parser.add_argument("--storm-timeout", type=float, default=120,
                        help="seconds the connect storm may take before the run fails")
    parser.add_argument("--source", choices=("config", "kube"), default="config",
                        help="where the mesh and its changes are written: a config dir, or a kube-apiserver "
                             "(etcd and kube-apiserver started here from the e2e binaries, `make e2e-bin`)")
    parser.add_argument("--xds-addr", help="an istiod already running (config source; then --config-dir is required)")
    parser.add_argument("--config-dir", type=Path, help="the config dir that istiod watches")
    parser.add_argument("--server-pid", type=int, help="the outside istiod's pid, for CPU and memory")
    parser.add_argument("--results", type=Path, default=Path("results"), help="where the JSON and plot go")
    parser.add_argument("--reference-istiod", metavar="PILOT_DISCOVERY",
                        help="kube source: measure Istio's own istiod (shared/reference-istiod/build.sh) instead "
                             "of ours; ztunnel clients then use its plaintext port")
    parser.add_argument("--istiod-arg", action="append", default=[],
                        help="a flag for the istiod started here (repeat it), e.g. --istiod-arg=--xds-workers=2")
    args = parser.parse_args()
    if args.xds_addr and (args.source != "config" or not args.config_dir):
        parser.error("--xds-addr needs --config-dir (and the config source): the benchmark makes its changes there")
    if args.generator is None:
        args.generator = "go" if GO_GENERATOR.exists() else "python"
        if args.generator == "python":
            print("load generator: Python workers (for the compiled one: bash bench/loadgen-go/build.sh)", flush=True)
    elif args.generator == "go" and not GO_GENERATOR.exists():
        parser.error(f"no compiled load generator at {GO_GENERATOR}: build it with `bash bench/loadgen-go/build.sh` (needs Go)")
    args.nodes = (args.nodes or args.ztunnel) if args.ztunnel else 0
    if args.ztunnel and args.source == "kube" and (args.proxyless or args.envoy):
        parser.error("--ztunnel through a kube-apiserver writes Pods, not EndpointSlices: use it with "
                     "--proxyless 0 --envoy 0 (the config dir serves both)")
    if args.reference_istiod and args.source != "kube":
        parser.error("--reference-istiod needs --source kube (Istio's istiod reads a cluster)")
    if (args.ztunnel or args.tls) and args.xds_addr:
        parser.error("--ztunnel and --tls need the istiod started here (its CA is plugged in by the bench)")
    if args.tls and (args.ztunnel or args.reference_istiod):
        parser.error("--tls is for sidecar and proxyless clients of our istiod (ztunnels use the secure port anyway)")
    if args.workers is None:
        args.workers = 1 if args.generator == "go" else 2
    # SIGTERM unwinds like Ctrl-C, so every process started here is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix="istiod-load-") as tmp, contextlib.ExitStack() as stack:
        result = run(args, Path(tmp), stack)
    args.results.mkdir(exist_ok=True)
    stem = args.results / time.strftime("load-%Y%m%dT%H%M%S")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(table(result))
    for code, details in result["stream_failure_details"].items():
        print(f"a stream failed {code}: {details}")
    png = stem.with_suffix(".png")
    print(f"results: {stem.with_suffix('.json')}" + (f", {png}" if plot(result, png) else " (no plot: pip install '.[bench]')"))


if __name__ == "__main__":
    main()

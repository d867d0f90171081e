"""`--xds-workers 2`: the plaintext xDS port served by two worker processes from the same snapshots,
with real gRPC xDS clients (grpcio, in subprocesses) on several connections; the debug views,
`proxy-status` and the xDS metrics show every worker's connections."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import render
from tests.peers import Istiod, Process, metric, wait_until
from tests.test_cli import istiod_cli, test_proxy_status_of_synced_proxies
from tests.test_debug_endpoints import (
    test_config_dump_holds_what_the_proxy_was_sent, test_connected_proxies_and_their_sync_state,
    test_proxy_queries_are_checked, test_push_status_and_config_dump_show_a_nack, test_push_status_reports_the_last_push,
)
from tests.test_metrics import (
    test_a_reject_stays_while_another_connection_of_the_proxy_has_it, test_connections_and_pushes_move_the_xds_metrics,
    test_counters_are_exposed_with_istio_names, test_nacks_of_each_type_count_as_rejects,
)
from tests.test_proxyless_grpc import SERVICE_PORT, echo_mesh, start_client, wait_for_replies

# The debug views', proxy-status's and the metrics' own tests, run here with their proxies on the
# workers (synced_mesh's istiod takes istiod_args).
__all__ = [
    "echo_mesh",  # the fixture
    "test_a_reject_stays_while_another_connection_of_the_proxy_has_it", "test_config_dump_holds_what_the_proxy_was_sent",
    "test_connected_proxies_and_their_sync_state", "test_connections_and_pushes_move_the_xds_metrics",
    "test_counters_are_exposed_with_istio_names", "test_nacks_of_each_type_count_as_rejects",
    "test_proxy_queries_are_checked", "test_proxy_status_of_synced_proxies", "test_push_status_and_config_dump_show_a_nack",
    "test_push_status_reports_the_last_push",
]
CLIENTS = 6


@pytest.fixture
def istiod_args() -> tuple[str, ...]:
    return ("--xds-workers", "2")


def test_clients_on_every_worker_converge_and_follow_a_change(
    mesh_dir: Path, echo_mesh: dict[str, tuple[str, int]], start_istiod: Callable[..., Istiod],
    start_demo: Callable[..., Process],
) -> None:
    istiod = start_istiod(mesh_dir, "--xds-workers", "2")
    clients = [start_client(start_demo, istiod, f"xds:///echo.echo-ns.svc.cluster.local:{SERVICE_PORT}")
               for _ in range(CLIENTS)]
    for client in clients:
        first = wait_until(lambda: next((line for line in client.drain() if line["ok"]), None), 15, "a first reply")
        assert first["reply"].startswith("echo-a ")
    pids = _worker_pids(istiod)
    assert len(pids) == 2, istiod.text()

    ip, port = echo_mesh["echo-b"]
    (mesh_dir / "pod-b.yaml").write_text(render("pod.yaml", pod="echo-b", app="echo", namespace="echo-ns", ip=ip, port=port))
    took = [wait_for_replies(client, {"echo-a", "echo-b"}) for client in clients]
    print(f"scale up seen by {CLIENTS} clients within {max(took):.2f}s of the last one checked")
    held = {pid: _connections(int(pid), int(istiod.ports["grpc"])) for pid in pids}
    print(f"connections per worker pid: {held}")
    assert sum(held.values()) == CLIENTS  # the kernel spreads them by address; each worker usually has some

    # The main process shows and counts every worker's: a connection's ID names the worker's pid.
    syncz = istiod.get("/debug/syncz")[1]
    by_pid = Counter(s["connection_id"].rsplit("-w", 1)[1].split(".")[0] for s in syncz)
    print(f"/debug/syncz connections by worker pid: {dict(by_pid)}")
    assert by_pid == {pid: n for pid, n in held.items() if n}
    assert istiod.get("/debug/connections")[1]["totalClients"] == CLIENTS
    assert metric(istiod.metrics(), "pilot_xds", version="unknown") == CLIENTS
    # The clients share one proxy ID: a row each.
    # The clients use an update before they ACK it: wait for the ACKs rather than catch one in flight.
    synced = "demo-client.echo-ns   Kubernetes   SYNCED   SYNCED   SYNCED   SYNCED"
    status = wait_until(lambda: (out := istiod_cli(istiod, "proxy-status").stdout).count(synced) == CLIENTS and out,
                        60, f"{CLIENTS} SYNCED rows in proxy-status")
    print(status)

    # A worker that dies is started again; its clients reconnect, to either worker, and follow changes.
    os.kill(int(max(pids, key=held.__getitem__)), signal.SIGKILL)
    wait_until(lambda: len(_worker_pids(istiod)) == 3, 15, "a new worker")
    (mesh_dir / "pod-a.yaml").unlink()
    took = [wait_for_replies(client, {"echo-b"}, timeout=10) for client in clients]
    print(f"after a worker was killed, scale down seen by all within {max(took):.2f}s of the last one checked")


def _worker_pids(istiod: Istiod) -> set[str]:
    return {line.split("pid=")[1].split()[0] for line in istiod.text().splitlines() if "xds worker started" in line}


def _connections(pid: int, port: int) -> int:
    """Established TCP connections on local `port` whose sockets `pid` holds (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = fd.readlink().name if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    count = 0
    for table in ("tcp", "tcp6"):  # grpcio listens on IPv6 sockets that take IPv4 too
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


def test_a_worker_leaves_out_the_kubernetes_client() -> None:
    # 50 MB of RSS in each worker, which never talks to the API server (the main process does).
    loaded = subprocess.run([sys.executable, "-c", "import sys; from istiod.xds import workers;"
                             " print(sorted({'kubernetes_asyncio', 'istiod.settings'} & set(sys.modules)))"],
                            capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert loaded == "[]"

"""`--xds-workers 2`: the plaintext xDS port served by two worker processes from the same snapshots,
with real gRPC xDS clients (grpcio, in subprocesses) on several connections."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from tests.conftest import render
from tests.peers import Istiod, Process, wait_until
from tests.test_proxyless_grpc import SERVICE_PORT, echo_mesh, start_client, wait_for_replies

__all__ = ["echo_mesh"]  # the fixture
CLIENTS = 6


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
    # Every connection is served by a worker: the main process has none on this port.
    assert istiod.get("/debug/syncz")[1] == []
    pids = _worker_pids(istiod)
    assert len(pids) == 2, istiod.text()

    ip, port = echo_mesh["echo-b"]
    (mesh_dir / "pod-b.yaml").write_text(render("pod.yaml", pod="echo-b", app="echo", namespace="echo-ns", ip=ip, port=port))
    took = [wait_for_replies(client, {"echo-a", "echo-b"}) for client in clients]
    print(f"scale up seen by {CLIENTS} clients within {max(took):.2f}s of the last one checked")
    held = {pid: _connections(int(pid), int(istiod.ports["grpc"])) for pid in pids}
    print(f"connections per worker pid: {held}")
    assert sum(held.values()) == CLIENTS  # the kernel spreads them by address; each worker usually has some

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

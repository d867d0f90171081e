"""`--xds-workers 2` with the secure port (15012) served by the workers: real peers over TLS with
their agent's certificate get and ACK their config from a worker process, a workload without a
certificate gets its first one with a token, and what is not a client of ours is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.conftest import synced
from tests.peers import Istiod, wait_until
from tests.test_agent_proxy import PROXY_ID, Sidecar, mesh, start_sidecar, workdir

__all__ = ["mesh", "start_sidecar", "workdir"]  # fixtures


def _served_by(istiod: Istiod, proxy: str) -> str:
    """The pid of the worker holding `proxy`'s connection, from its connection ID (`<proxy>-w<pid>.<n>`)."""
    _, syncz = istiod.get("/debug/syncz")
    [entry] = [s for s in syncz if s["proxy"] == proxy]
    return str(entry["connection_id"]).rsplit("-w", 1)[1].split(".")[0]


def test_envoy_gets_its_config_from_a_worker_over_the_secure_port(
    mesh: Path, mesh_dir: Path, start_istiod: Callable[..., Istiod], start_sidecar: Callable[..., Sidecar],
) -> None:
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(mesh), "--xds-workers", "2")
    start_sidecar(istiod)
    wait_until(lambda: synced(istiod, PROXY_ID, ("cluster", "endpoint", "listener")), 20,
               "istiod to see Envoy's ACKs")
    pid = _served_by(istiod, PROXY_ID)
    print(f"Envoy's stream is served by worker pid {pid} (istiod is {istiod.proc.pid})")
    assert int(pid) != istiod.proc.pid

"""One slow or hostile xDS client never hurts the others (issue: ADS isolation and limits).

Hostile load is hand-written (tests/hostile.py, raw sockets); the clients that must keep working
are real grpcio xDS clients in subprocesses.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import render
from tests.peers import Istiod, Process, metric, wait_until
from tests.test_proxyless_grpc import SERVICE_PORT, echo_mesh, start_client, wait_for_replies  # noqa: F401

ECHO = f"xds:///echo.echo-ns.svc.cluster.local:{SERVICE_PORT}"


def connections(istiod: Istiod) -> list[str]:
    status, body = istiod.get("/debug/connections")
    assert status == 200, body
    return [c["connectionId"] for c in body["clients"]]


def test_streams_that_never_read_cost_only_themselves(
    mesh_dir: Path, echo_mesh: dict, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process],
    processes: list[Process],
) -> None:
    stalled = 200  # twice istiod's push throttle (PILOT_PUSH_THROTTLE=100)
    istiod = start_istiod(mesh_dir, "--xds-send-timeout", "20s")
    client = start_client(start_demo, istiod, ECHO)
    wait_until(lambda: any(line["ok"] for line in client.drain()), 15, "the first client's first reply")

    hostile = Process([sys.executable, "-m", "tests.hostile", "stall", istiod.xds_address, str(stalled)], name="hostile")
    processes.append(hostile)
    assert hostile.next_json(30) == {"streams": stalled}
    wait_until(lambda: sum("stall-" in c for c in connections(istiod)) == stalled, 20, "the stalled streams")

    started = time.monotonic()
    newcomer = start_client(start_demo, istiod, ECHO)
    wait_until(lambda: any(line["ok"] for line in newcomer.drain()), 20, "a new client's first reply")
    print(f"with {stalled} streams that never read: a new client's first reply in {time.monotonic() - started:.2f}s")

    ip, port = echo_mesh["echo-b"]
    (mesh_dir / "pod-b.yaml").write_text(render("pod.yaml", pod="echo-b", app="echo", namespace="echo-ns", ip=ip, port=port))
    print(f"scale up converged in {wait_for_replies(client, {'echo-a', 'echo-b'}):.2f}s"
          f" (new client {wait_for_replies(newcomer, {'echo-a', 'echo-b'}):.2f}s)")
    (mesh_dir / "pod-a.yaml").unlink()
    print(f"scale down converged in {wait_for_replies(client, {'echo-b'}):.2f}s")

    # The send deadline closes exactly the stalled streams, each with a log line and a count.
    wait_until(lambda: not any("stall-" in c for c in connections(istiod)), 60, "the stalled streams to be closed")
    timeouts = metric(istiod.metrics(), "pilot_xds_write_timeout")
    print(f"stalled streams closed by the send deadline: {timeouts:g}; "
          f"log lines: {istiod.text().count('ads send timeout')}")
    assert timeouts == stalled
    assert sorted(c.split("~")[2] for c in connections(istiod)) == ["demo-client.echo-ns"] * 2
    assert replies_ok(client) and replies_ok(newcomer)


def replies_ok(client: Process) -> bool:
    return wait_until(lambda: any(line["ok"] for line in client.drain()), 5, "a reply")

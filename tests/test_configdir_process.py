"""The config dir under istiod as it runs, seen by real grpcio xDS clients: a directory replaced,
special files, and addresses the API server would refuse never cost the mesh."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import CLIENT_PROXY, ECHO_PORT, Mesh, render
from tests.peers import Istiod, Process, metric, wait_until


def replies(client: Process, window: float) -> list[dict[str, Any]]:
    """What the client printed over the next `window` seconds."""
    client.drain()
    time.sleep(window)
    return client.drain()


def test_dir_replaced_keeps_serving_and_applies_the_new_contents(synced_mesh: Mesh, tmp_path: Path) -> None:
    mesh, istiod = synced_mesh.dir, synced_mesh.istiod
    new = tmp_path / "new"
    shutil.copytree(mesh, new)
    (new / "svc2.yaml").write_text(render("service.yaml", name="echo2", namespace="echo-ns", port=ECHO_PORT))

    shutil.rmtree(mesh)  # gone for a while: the volume unmounted, or `rm -rf d` before `cp -r new d`
    seen = replies(synced_mesh.client, 1.5)
    assert seen and all(line["ok"] for line in seen), seen
    assert istiod.get("/ready")[0] == 200
    assert metric(istiod.metrics(), "pilot_config_dir_errors", type="dir") > 0
    assert f"config dir {mesh}: No such file or directory; keeping the last good state" in istiod.text()

    shutil.copytree(new, mesh)
    wait_until(lambda: "echo2.echo-ns.svc.cluster.local" in str(istiod.get("/debug/registryz")[1]), 5,
               "the new Service once the dir is back")
    seen = replies(synced_mesh.client, 0.5)
    assert seen and all(line["ok"] for line in seen), seen
    print(f"{len(seen)} calls ok after the dir came back; errors counted:",
          metric(istiod.metrics(), "pilot_config_dir_errors", type="dir"))


def test_addresses_the_api_server_refuses_never_reach_clients(synced_mesh: Mesh) -> None:
    mesh, istiod = synced_mesh.dir, synced_mesh.istiod
    (mesh / "pod-bad.yaml").write_text(render("pod.yaml", pod="echo-bad", app="echo", namespace="echo-ns",
                                              ip="999.1.1.1", port=synced_mesh.server_port))
    (mesh / "slice-bad.yaml").write_text(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n"
        "metadata: {name: echo-bad, namespace: echo-ns, labels: {kubernetes.io/service-name: echo}}\n"
        f"addressType: IPv4\nports: [{{name: grpc, port: {synced_mesh.server_port}}}]\n"
        "endpoints: [{addresses: [not-an-ip]}]\n")
    wait_until(lambda: "Pod echo-ns/echo-bad: status.podIP: '999.1.1.1' is not an IP address" in istiod.text()
               and "EndpointSlice echo-ns/echo-bad: endpoints[0].addresses[0]: 'not-an-ip' is not an IPv4 address"
               in istiod.text(), 5, "both objects refused")
    seen = replies(synced_mesh.client, 1.0)
    assert seen and all(line["ok"] for line in seen), seen
    status, syncz = istiod.get("/debug/syncz")
    client = next(s for s in syncz if s["proxy"] == CLIENT_PROXY)
    assert not [k for k in client if k.endswith("_nacked_error")], client


def test_fifo_never_blocks_sync_or_shutdown(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    os.mkfifo(mesh_dir / "pipe.yaml")  # istiod starts ready although nothing ever writes to it
    istiod = start_istiod(mesh_dir)
    os.mkfifo(mesh_dir / "later.yaml")  # and one that appears while it runs
    wait_until(lambda: f"config dir entry {mesh_dir / 'later.yaml'}: not a regular file; skipped" in istiod.text(), 5,
               "the new FIFO reported")
    assert istiod.get("/ready")[0] == 200
    started = time.monotonic()
    istiod.proc.send_signal(signal.SIGTERM)
    try:
        code = istiod.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"istiod ignored SIGTERM; log:\n{istiod.log()}") from None
    print(f"stopped {time.monotonic() - started:.2f}s after SIGTERM, exit code {code}")
    assert code == 0, istiod.log()

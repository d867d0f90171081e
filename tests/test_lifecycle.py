"""istiod's lifecycle seen by real peers: SIGTERM drains (readiness first, new streams refused, open
ones sent a GOAWAY and closed within --shutdown-duration, exit 0), and the gRPC xDS clients of a
replica that dies move to another replica and keep serving."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from tests.ads_client import AdsClient
from tests.conftest import CLIENT_PROXY, DATA, ECHO_HOST, ECHO_PORT, render, synced
from tests.envoy_peer import sidecar_envoy
from tests.peers import Istiod, Process, eventually, free_port, wait_until
from tests.test_envoy_sidecar import CART, PROXY, TYPES, _dynamic, captured_pod

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
SHUTDOWN = 3.0  # --shutdown-duration in these tests


def echo_mesh(mesh_dir: Path) -> str:
    """Namespace echo-ns with Service echo and its pod echo-a; echo-a's address."""
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="echo", namespace="echo-ns", port=ECHO_PORT))
    ip, port = "127.0.0.21", free_port("127.0.0.21")
    (mesh_dir / "pod-a.yaml").write_text(render("pod.yaml", pod="echo-a", app="echo", namespace="echo-ns", ip=ip, port=port))
    return f"{ip}:{port}"


def echo_peers(start_demo: Callable[..., Process], address: str, xds: str) -> Process:
    """echo-a as an xDS-enabled server and a client calling echo every 0.1 s, both with `xds` as
    their bootstrap's server URI; the client, once its first call succeeded."""
    start_demo("server", "--address", address, "--name", "echo-a", "--xds", xds, "--namespace", "echo-ns", name="echo-a")
    client = start_demo("client", f"xds:///{ECHO_HOST}:{ECHO_PORT}", "--xds", xds, "--count", "0",
                        "--interval", "0.1", "--timeout", "1", "--namespace", "echo-ns", name="client")
    wait_until(lambda: any(line["ok"] for line in client.drain()), 20, "the client's first reply")
    return client


async def test_sigterm_fails_ready_refuses_new_streams_drains_open_ones_and_exits_0(
        mesh_dir: Path, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process],
        ads_client: Callable[..., AdsClient]) -> None:
    address = echo_mesh(mesh_dir)
    istiod = start_istiod(mesh_dir, "--shutdown-duration", f"{SHUTDOWN}s")
    client = echo_peers(start_demo, address, istiod.xds_address)
    watcher = ads_client(istiod, "watcher", "echo-ns")
    watcher.send(CLUSTER, [])
    await watcher.receive()
    client.drain()

    sigterm = time.monotonic()
    istiod.proc.send_signal(signal.SIGTERM)
    await eventually(lambda: istiod.get("/ready")[0] != 200, 5, "/ready to fail")
    ready_failed = time.monotonic() - sigterm
    status, reason = istiod.get("/ready")

    late = ads_client(istiod, "late", "echo-ns")
    late.send(CLUSTER, [])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await late.receive()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value

    # A GOAWAY takes the open connection out of READY while its stream is still served.
    await eventually(lambda: watcher.channel.get_state() != grpc.ChannelConnectivity.READY, 5, "a GOAWAY")
    goaway = time.monotonic() - sigterm
    assert not watcher._call.done()
    await eventually(watcher._call.done, SHUTDOWN + 5, "the open stream to be closed")
    drained = time.monotonic() - sigterm
    code = await watcher._call.code()

    exit_code = await eventually(lambda: istiod.proc.poll() is not None and (istiod.proc.returncode,), 15,
                                 "istiod to exit")
    exited = time.monotonic() - sigterm
    assert exit_code == (0,), istiod.log()
    calls = client.drain()
    assert calls and all(line["ok"] for line in calls), calls  # the data plane never waits for istiod
    print(f"SIGTERM -> /ready {status} {reason!r} after {ready_failed:.2f}s; new stream refused: "
          f"{refused.value.code().name} {refused.value.details()!r}; GOAWAY seen after {goaway:.2f}s; "
          f"open stream closed ({code.name}) after {drained:.2f}s (--shutdown-duration {SHUTDOWN}s); "
          f"exit 0 after {exited:.2f}s; {len(calls)} client calls meanwhile, all ok")


def two_replicas(mesh_dir: Path, tmp_path: Path, processes: list[Process]) -> list[Istiod]:
    """Two istiods serving the same config dir, as two replicas serve the same cluster."""
    replicas = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        replicas.append(Istiod(tmp_path / name, "--config-dir", str(mesh_dir), "--poll-interval", "100ms"))
        processes.append(replicas[-1])
    return replicas


def test_grpc_client_of_a_killed_replica_moves_to_the_other_and_keeps_serving(
        mesh_dir: Path, tmp_path: Path, processes: list[Process], start_demo: Callable[..., Process]) -> None:
    address = echo_mesh(mesh_dir)
    first, second = two_replicas(mesh_dir, tmp_path, processes)
    # One target listing both replicas, as a Service's addresses would: pick_first takes the first.
    xds = f"ipv4:{first.xds_address},{second.xds_address}"
    client = echo_peers(start_demo, address, xds)
    prefixes = ("cluster", "listener", "endpoint", "route")
    wait_until(lambda: synced(first, CLIENT_PROXY, prefixes), 10, "the client to be synced by the first replica")

    client.drain()
    killed = time.monotonic()
    first.proc.kill()
    wait_until(lambda: synced(second, CLIENT_PROXY, prefixes), 30, "the client to be synced by the second replica")
    reconnected = time.monotonic() - killed
    during = client.drain()
    time.sleep(2)
    after = client.drain()
    assert after and all(line["ok"] for line in after), after
    failed = [line for line in during if not line["ok"]]
    print(f"replica killed; client synced by the other after {reconnected:.2f}s; calls meanwhile "
          f"{len(during)} ({len(failed)} failed), {len(after)} calls in the 2s after, all ok")



def test_envoy_of_a_killed_replica_moves_to_the_other_and_keeps_its_config(
        mesh_dir: Path, tmp_path: Path, processes: list[Process]) -> None:
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (Debian's package) for the capture rules")
    shutil.copy(DATA / "sidecar-mesh.yaml", mesh_dir / "mesh.yaml")
    replicas = two_replicas(mesh_dir, tmp_path, processes)
    # xds-grpc lists both replicas, as pilot-agent's points at istiod's Service.
    with sidecar_envoy(replicas[0].xds_address, "web-1", "shop", "127.0.0.31", service_account="web",
                       more_xds=(replicas[1].xds_address,)) as envoy:
        wait_until(lambda: envoy.get("/ready")[0] == 200, 20, "Envoy ready")
        serving = wait_until(lambda: [r for r in replicas if synced(r, PROXY, TYPES)], 20, "Envoy synced")[0]
        survivor = next(r for r in replicas if r is not serving)
        clusters = set(_dynamic(envoy.config_dump(), "clusters"))
        ready: list[int] = []
        with captured_pod(serving, envoy) as run:
            def call() -> bool:  # web-1 to its own Service's VIP, out and back in through Envoy
                return run("curl", "-s", "--max-time", "5", "http://10.96.0.10/").stdout.startswith("{")

            wait_until(call, 10, "traffic through the sidecar")
            calls: list[bool] = []
            killed = time.monotonic()
            serving.proc.kill()

            def moved() -> bool:
                ready.append(envoy.get("/ready")[0])
                calls.append(call())
                return synced(survivor, PROXY, TYPES)

            wait_until(moved, 30, "Envoy synced by the other replica")
            reconnected = time.monotonic() - killed
            after = [call() for _ in range(10)]
        assert set(ready) == {200}, ready
        assert all(after), after  # no request fails once the other replica serves
        assert set(_dynamic(envoy.config_dump(), "clusters")) == clusters
        print(f"calls through Envoy while it moved: {calls.count(True)} of {len(calls)} ok; after: {sum(after)} of 10 ok")

        (mesh_dir / "cart.yaml").write_text(CART)  # the survivor serves changes
        wait_until(lambda: "outbound|9090||cart.shop.svc.cluster.local" in _dynamic(envoy.config_dump(), "clusters"),
                   15, "a new service to reach Envoy through the survivor")
        print(f"replica killed; Envoy synced by the other after {reconnected:.2f}s, /ready 200 in all "
              f"{len(ready)} probes meanwhile, its {len(clusters)} clusters kept; a new service arrived after")

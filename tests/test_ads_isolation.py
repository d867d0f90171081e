"""One slow or hostile xDS client never hurts the others (issue: ADS isolation and limits).

Hostile load is hand-written (tests/hostile.py, raw sockets); the clients that must keep working
are real grpcio xDS clients in subprocesses.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from istiod.sources.store import Store
from istiod.xds import admission, types
from istiod.xds.pusher import Pusher
from istiod.xds.server import MAX_RESOURCE_NAMES, DiscoveryServer, _SendDeadline, add_to_server
from istiod.connlimit import IDLE_TIMEOUT, RESERVED_FDS
from istiod.server import FDS_PER_CONNECTION
from tests.ads_client import AdsClient
from tests.conftest import render
from tests.hostile import NOT_READING, closed, idle_http2, node
from tests.peers import Istiod, Process, eventually, metric, wait_until
from tests.test_ads import Stream, service
from tests.test_mtls import Workload, mesh, run_agent  # noqa: F401
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


async def serve_in_process(objects: list[dict], **options: Any) -> tuple[DiscoveryServer, grpc.aio.Server, str]:
    """An ADS server in this process (its state can be looked at) serving `objects`, and its address."""
    store = Store()
    for obj in objects:
        store.apply(obj)
    pusher = Pusher(store)
    discovery = DiscoveryServer(lambda: pusher.snapshot, **options)
    pusher.publish(full=True)
    discovery.ready = True
    server = grpc.aio.server(options=admission.CORE_OPTIONS)
    add_to_server(discovery, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return discovery, server, address


async def test_streams_that_never_read_do_not_hold_the_send_budget() -> None:
    """The issue's 100 streams on one connection of a 1000-Service mesh filling the 32 MB budget, scaled
    down: 200 streams on 10 connections, each stream's first response ~20 kB, a 256 kB budget. A fresh
    client must get its config while every hostile stream is still open (the send timeout is 60 s)."""
    discovery, server, address = await serve_in_process([service(f"svc-{i}") for i in range(100)],
                                                        send_timeout=60, send_budget=256 << 10)
    hostile = await asyncio.create_subprocess_exec(sys.executable, "-m", "tests.hostile", "stall", address, "200", "20",
                                                   stdout=asyncio.subprocess.PIPE, start_new_session=True)
    channel = grpc.aio.insecure_channel(address)
    try:
        assert hostile.stdout is not None
        assert b'"streams": 200' in await asyncio.wait_for(hostile.stdout.readline(), 30)
        await eventually(lambda: len(discovery.connections) == 200, 20, "the stalled streams")
        stalled = set(discovery.connections)
        await eventually(lambda: discovery._send_budget.used > (200 << 10), 20, "the stalled writes to fill the budget")

        fresh = Stream(ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel))
        fresh.send(types.CLUSTER)
        response = await fresh.receive(timeout=20)  # generous: the point is that it comes before the streams end
        print(f"a fresh client got {len(response.resources)} clusters while {len(stalled)} streams on 10 connections "
              f"never read; the budget held {discovery._send_budget.used >> 10} kB")
        assert len(response.resources) == 100
        assert stalled <= set(discovery.connections)  # all still open: nothing timed out to let it through
    finally:
        os.killpg(hostile.pid, signal.SIGKILL)
        await hostile.wait()
        await channel.close()
        await server.stop(None)


async def test_made_up_names_cost_their_bytes_within_bounds_and_go_with_their_streams() -> None:
    """The issue's 76 MB of unknown names over a few streams, scaled down with the bound (1 MB a stream,
    2 MB a connection): refused past the bounds with a clear status, counted at their bytes meanwhile,
    nothing of them left once the streams end, and a fresh client served all along."""
    discovery, server, address = await serve_in_process([service("known")], max_name_bytes=1 << 20)
    hostile, other = grpc.aio.insecure_channel(address), grpc.aio.insecure_channel(address)
    try:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(hostile)

        def made_up(prefix: str, size: int) -> list[str]:  # cluster-shaped, so the push index sees them too
            return [f"outbound|80||{prefix}-{i:0>80}.demo.svc.cluster.local" for i in range(size // 120)]

        # Delta: subscriptions add up on a stream until past its bound.
        delta = stub.DeltaAggregatedResources()
        for i in range(3):
            await delta.write(discovery_pb2.DeltaDiscoveryRequest(
                type_url=types.CLUSTER, node=node("delta") if i == 0 else None, resource_names_subscribe=made_up(f"d{i}", 400_000)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            while True:
                await asyncio.wait_for(delta.read(), 10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        print(f"delta past the bound: {refused.value.details()}")
        assert "at most 1048576 a stream" in refused.value.details()

        # State of the world: streams under the bound each, past it together on one connection.
        streams, sent = [], 0
        for i in range(3):
            call = stub.StreamAggregatedResources()
            names = made_up(f"s{i}", 900_000)
            await call.write(discovery_pb2.DiscoveryRequest(type_url=types.ENDPOINT, node=node(f"sotw-{i}"), resource_names=names))
            streams.append(call)
            if i < 2:
                await asyncio.wait_for(call.read(), 10)
                sent += sum(map(len, names))
                assert discovery.name_bytes == {discovery.connections[max(discovery.connections)].peer: sent}
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(streams[2].read(), 10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        print(f"a third stream on the connection: {refused.value.details()}")
        assert "at most 2097152 a connection" in refused.value.details()

        fresh = Stream(ads_pb2_grpc.AggregatedDiscoveryServiceStub(other))
        fresh.send(types.CLUSTER)
        assert len((await fresh.receive(timeout=10)).resources) == 1  # served while the others hold theirs

        for call in streams[:2]:
            call.cancel()
        await eventually(lambda: len(discovery.connections) == 1, 10, "the hostile streams to end")
        # Nothing of the made-up names is left: not counted, not indexed, not remembered for the snapshot.
        assert discovery.name_bytes == {}
        assert not any(discovery.watchers._groups.values())
        memo = [made for made in discovery.cache._shared.values() if isinstance(made, dict)]
        assert all(len(made) <= 1 for made in memo), [len(made) for made in memo]
    finally:
        await hostile.close()
        await other.close()
        await server.stop(None)


def replies_ok(client: Process) -> bool:
    return wait_until(lambda: any(line["ok"] for line in client.drain()), 5, "a reply")


def vm_rss_mb(istiod: Istiod) -> float:
    for line in Path(f"/proc/{istiod.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def echo_istiod(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> Callable[..., Istiod]:
    """istiod serving namespace echo-ns with Service echo (no pods)."""
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="echo", namespace="echo-ns", port=SERVICE_PORT))
    return lambda *flags: start_istiod(mesh_dir, *flags)


class _Writes:
    """A stream's context.write taking `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def write(self, message: bytes) -> None:
        await asyncio.sleep(self.seconds)


async def test_a_write_done_while_the_loop_was_busy_past_the_deadline_is_no_timeout() -> None:
    """As in a connect storm: the write finishes during a long stretch of other work, so the loop learns
    of it only after that work, just when the deadline's timer is due too."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    class Write:
        async def write(self, message: bytes) -> None:
            await done

    def busy() -> None:
        time.sleep(0.8)  # past the deadline
        loop.call_soon(done.set_result, None)  # the write's completion, seen after the work

    deadline = _SendDeadline(0.5)
    loop.call_later(0.1, busy)
    await deadline.write(Write(), b"")  # type: ignore[arg-type]
    deadline.close()


async def test_the_send_deadline_is_per_write_and_an_outside_cancel_stays_a_cancel() -> None:
    deadline = _SendDeadline(0.5)
    context = _Writes(0.01)
    started = time.monotonic()
    while time.monotonic() - started < 1.0:  # writes for twice the deadline, each well within it
        await deadline.write(context, b"")  # type: ignore[arg-type]
    context.seconds = 60
    with pytest.raises(TimeoutError):
        await deadline.write(context, b"")  # type: ignore[arg-type]
    deadline.close()

    async def stream() -> None:
        deadline = _SendDeadline(60)
        try:
            await deadline.write(context, b"")  # type: ignore[arg-type]
        finally:
            deadline.close()

    task = asyncio.create_task(stream())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_requests_wait_for_their_stream_so_flow_control_holds_the_client_back(
    echo_istiod: Callable[..., Istiod],
) -> None:
    istiod = echo_istiod("--xds-send-timeout", "60s")
    before = vm_rss_mb(istiod)
    channel = grpc.aio.insecure_channel(istiod.xds_address, options=NOT_READING)
    try:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url=types.CLUSTER, node=node("flood")))
        megabyte = discovery_pb2.DiscoveryRequest(type_url=types.CLUSTER, resource_names=[f"{i:0>1000}" for i in range(1000)])
        sent = 0
        while sent < 200:  # 200 MB if nothing holds the client back
            write = asyncio.ensure_future(call.write(megabyte))
            done, _ = await asyncio.wait({write}, timeout=3)
            if not done:
                break
            sent += 1
        grown = vm_rss_mb(istiod) - before
        print(f"1 MB requests on a stream that does not read: {sent} taken before the client was held back; "
              f"istiod grew {grown:.0f} MB")
        assert sent < 50
        call.cancel()
    finally:
        await channel.close()


async def test_names_are_deduplicated_and_capped(
    echo_istiod: Callable[..., Istiod], ads_client: Callable[..., AdsClient],
) -> None:
    istiod = echo_istiod()
    cluster = f"outbound|{SERVICE_PORT}||echo.echo-ns.svc.cluster.local"
    client = ads_client(istiod, "dup", "echo-ns")
    client.send(types.CLUSTER, [cluster] * 50_000)
    response = await client.receive()
    print(f"a request naming one cluster 50000 times: {len(response.resources)} resource, "
          f"{response.ByteSize()} bytes")
    assert len(response.resources) == 1
    status, body = istiod.get("/debug/connections")
    (watching,) = [c for c in body["clients"] if "dup." in c["proxy"]]
    assert watching["watches"][types.CLUSTER] == [cluster]

    client = ads_client(istiod, "many", "echo-ns")
    client.send(types.CLUSTER, [f"c{i}" for i in range(MAX_RESOURCE_NAMES + 1)])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.receive()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    print(f"{MAX_RESOURCE_NAMES + 1} names: {refused.value.details()}")


async def test_malformed_requests_are_refused_without_a_traceback(
    echo_istiod: Callable[..., Istiod],
) -> None:
    istiod = echo_istiod()
    method = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
    good_first = discovery_pb2.DiscoveryRequest(type_url=types.CLUSTER, node=node("garbage")).SerializeToString()
    started = time.monotonic()
    async with grpc.aio.insecure_channel(istiod.xds_address) as channel:
        for attempt in range(30):
            call = channel.stream_stream(method)()  # raw bytes both ways
            if attempt % 2:
                await call.write(good_first)  # malformed after a good first request, too
            await call.write(b"\xff\xff\xff\xff not a protobuf")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:  # the status comes after the response to the good request
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        details = refused.value.details()
    seconds = time.monotonic() - started
    await asyncio.sleep(1.5)
    lines = istiod.text().count("ads malformed request")
    print(f"30 malformed requests in {seconds:.1f}s: INVALID_ARGUMENT ({details}); {lines} log lines")
    assert "Traceback" not in istiod.text()
    assert 1 <= lines <= seconds + 2  # at most one a second


def test_vanished_proxies_go_as_fast_from_the_secure_port_as_from_the_plaintext_one(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],
    start_demo: Callable[..., Process], start_agent: Callable[..., Process],
) -> None:
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(tmp_path / "tokens.json"),
                          "--keepaliveInterval", "1s", "--keepaliveTimeout", "1s")
    workload = mesh["client"]
    run_agent(start_agent, istiod, workload)
    target = f"xds:///xecho.echo-ns.svc.cluster.local:{SERVICE_PORT}"
    clients = {  # real grpcio xDS clients, one per port; frozen below, as a vanished host is
        "15012": start_demo("client", target, "--xds", istiod.secure_address, "--namespace", "echo-ns", "--count", "0",
                            env={"GRPC_XDS_BOOTSTRAP": str(workload.bootstrap)}, name="secure-client"),
        "15010": start_demo("client", target, "--xds", istiod.xds_address, "--namespace", "echo-ns", "--count", "0",
                            name="plain-client"),
    }
    pods = {"15012": f"{workload.pod}.echo-ns", "15010": "demo-client.echo-ns"}

    def connected(port: str) -> bool:
        return any(c.split("~")[2] == pods[port] for c in connections(istiod))

    wait_until(lambda: all(connected(port) for port in clients), 20, "both clients' ADS connections")
    for client in clients.values():
        os.killpg(client.proc.pid, signal.SIGSTOP)
    try:
        frozen = time.monotonic()
        gone = {}
        while len(gone) < len(clients):
            for port in clients.keys() - gone.keys():
                if not connected(port):
                    gone[port] = time.monotonic() - frozen
            assert time.monotonic() - frozen < 30, f"still connected after 30s: {clients.keys() - gone.keys()}"
            time.sleep(0.1)
        print("frozen proxies dropped (keepalive 1s/1s): " + ", ".join(f"{p} after {s:.1f}s" for p, s in sorted(gone.items())))
    finally:
        for client in clients.values():
            os.killpg(client.proc.pid, signal.SIGCONT)


def open_fds(istiod: Istiod) -> int:
    return len(os.listdir(f"/proc/{istiod.proc.pid}/fd"))


def test_idle_sockets_cannot_use_up_fds_and_real_clients_are_served(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],
    start_agent: Callable[..., Process],
) -> None:
    cap, idle = 100, 300
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(tmp_path / "tokens.json"),
                          "--max-connections", str(cap), "--http-read-timeout", "3s")
    before = open_fds(istiod)
    sockets: list[socket.socket] = []
    try:
        tls = ssl.create_default_context()
        tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
        for port in ("http", "monitoring", "secure-grpc", "webhook"):
            for i in range(idle):
                sock = socket.create_connection(("127.0.0.1", istiod.ports[port]), timeout=5)
                if port == "webhook":  # asyncio bounds a handshake (60s); past it the HTTP guards apply
                    sock = tls.wrap_socket(sock)
                if i % 3 == 0:  # a slowloris: part of a request, never the rest
                    sock.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\n" if port != "secure-grpc" else b"\x16\x03\x01")
                sockets.append(sock)
        time.sleep(0.5)
        during = open_fds(istiod)
        # Real clients are served meanwhile: probes, a scrape, and a workload's certificate over 15012.
        assert istiod.get("/ready")[0] == 200
        assert istiod.get("/metrics", port="monitoring")[0] == 200
        run_agent(start_agent, istiod, mesh["client"])
        served = open_fds(istiod)
        # Without traffic the idle ones go within the read and handshake timeouts.
        wait_until(lambda: open_fds(istiod) <= before + 10, 20, "istiod to close the idle sockets")
        after = open_fds(istiod)
    finally:
        for sock in sockets:
            sock.close()
    print(f"istiod's fds: {before} before, {during} with {idle} idle sockets on each of 8080, 15014, 15012, 15017 "
          f"(cap {cap} a port), {served} while real clients were served, {after} after the timeouts")
    assert during <= before + 4 * cap + 10


def test_idle_http2_connections_on_the_secure_port_give_way_and_go(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],
    start_agent: Callable[..., Process],
) -> None:
    """HTTP/2 over TLS, no credentials, no stream, as many as --max-connections: a workload still gets
    its certificate (the oldest idle connection gives way), and istiod closes them all within IDLE_TIMEOUT."""
    cap = 20
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(tmp_path / "tokens.json"), "--max-connections", str(cap))
    idle = [idle_http2(istiod.ports["secure-grpc"]) for _ in range(cap)]
    try:
        opened = time.monotonic()
        run_agent(start_agent, istiod, mesh["client"])
        print(f"with {cap} idle HTTP/2 connections at --max-connections {cap}: a certificate in "
              f"{time.monotonic() - opened:.1f}s")
        wait_until(lambda: all(closed(sock) for sock in idle), IDLE_TIMEOUT + 20, "istiod to close the idle connections")
        print(f"all {cap} closed by istiod {time.monotonic() - opened:.1f}s after they opened (IDLE_TIMEOUT {IDLE_TIMEOUT:g}s)")
    finally:
        for sock in idle:
            sock.close()


def test_connection_caps_fit_the_open_files_limit(
    mesh: dict[str, Workload], mesh_dir: Path, tmp_path: Path, start_istiod: Callable[..., Istiod],
    start_agent: Callable[..., Process],
) -> None:
    """The default --max-connections (4096) under an open files limit that cannot be raised (512): the caps
    are sized to fit, so a flood of idle sockets on every port leaves fds for real clients."""
    limit = 512
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(tmp_path / "tokens.json"), open_files=limit)
    cap = (limit - RESERVED_FDS) // FDS_PER_CONNECTION
    assert f"cap={cap}" in istiod.text() and "connection cap lowered" in istiod.text()
    sockets = []
    try:
        for port in ("grpc", "http", "monitoring", "secure-grpc", "webhook"):
            sockets += [socket.create_connection(("127.0.0.1", istiod.ports[port]), timeout=5) for _ in range(limit // 4)]
        time.sleep(0.5)
        during = open_fds(istiod)
        assert istiod.get("/ready")[0] == 200
        assert istiod.get("/metrics", port="monitoring")[0] == 200
        run_agent(start_agent, istiod, mesh["client"])  # a certificate over 15012
    finally:
        for sock in sockets:
            sock.close()
    print(f"open files limit {limit}: cap {cap} a port; {len(sockets)} idle sockets held istiod at {during} fds, "
          f"and real clients were served")
    assert during < limit - RESERVED_FDS // 2


def test_soft_open_files_limit_is_raised_to_the_hard_one(
    mesh_dir: Path, start_istiod: Callable[..., Istiod],
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # inherited by istiod
    try:
        istiod = start_istiod(mesh_dir)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    line = next(l for l in Path(f"/proc/{istiod.proc.pid}/limits").read_text().splitlines() if l.startswith("Max open files"))
    print(f"started with a soft limit of 256: {line}")
    assert line.split()[3:5] == [str(hard), str(hard)]

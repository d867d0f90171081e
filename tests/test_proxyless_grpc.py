"""Real gRPC xDS clients and servers (grpcio, in subprocesses) against istiod on a config dir."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import render
from tests.peers import Istiod, Process, free_port, wait_until

SERVICE_PORT = 7070
CHANGE_DEADLINE = 2.0  # the bound on how fast a client sees a change


@pytest.fixture
def echo_mesh(mesh_dir: Path, start_demo: Callable[..., Process]) -> dict[str, object]:
    """Namespace `echo-ns`, Service `echo` and pod A with a live backend on 127.0.0.21."""
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="echo", namespace="echo-ns", port=SERVICE_PORT))
    backends = {}
    for pod, ip in (("echo-a", "127.0.0.21"), ("echo-b", "127.0.0.22")):
        port = free_port(ip)
        backends[pod] = (ip, port)
        start_demo("server", "--address", f"{ip}:{port}", "--name", pod, name=pod).next_json(15)
    ip, port = backends["echo-a"]
    (mesh_dir / "pod-a.yaml").write_text(render("pod.yaml", pod="echo-a", app="echo", namespace="echo-ns", ip=ip, port=port))
    return backends


def replies_from(client: Process, window: float) -> set[str]:
    """The backends (or error codes) the client saw over the next `window` seconds."""
    client.drain()
    time.sleep(window)
    return {line["reply"].split()[0] if line["ok"] else line["code"] for line in client.drain()}


def wait_for_replies(client: Process, expected: set[str], timeout: float = CHANGE_DEADLINE) -> float:
    """Seconds until a 0.5 s window of calls saw exactly `expected`; fails after `timeout` (+window)."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        client.drain()
        seen: set[str] = set()
        window_end = time.monotonic() + 0.5
        while time.monotonic() < window_end:
            line = client.next_json(5)
            seen.add(line["reply"].split()[0] if line["ok"] else line["code"])
        if seen == expected:
            return time.monotonic() - started
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout}s the client sees {seen}, expected {expected}")


def start_client(start_demo: Callable[..., Process], istiod: Istiod, target: str, namespace: str = "echo-ns") -> Process:
    """A client calling `target` every 50 ms until stopped, one JSON line per call."""
    return start_demo("client", target, "--xds", istiod.xds_address, "--count", "0", "--interval", "0.05",
                      "--timeout", "1", "--namespace", namespace, name="client")


def test_client_reaches_backend_and_follows_changes(
    mesh_dir: Path, echo_mesh: dict, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process]
) -> None:
    istiod = start_istiod(mesh_dir)
    client = start_client(start_demo, istiod, f"xds:///echo.echo-ns.svc.cluster.local:{SERVICE_PORT}")
    first = wait_until(lambda: next((l for l in client.drain() if l["ok"]), None), 15, "a first reply")
    assert first["reply"].startswith("echo-a ")

    ip, port = echo_mesh["echo-b"]
    (mesh_dir / "pod-b.yaml").write_text(render("pod.yaml", pod="echo-b", app="echo", namespace="echo-ns", ip=ip, port=port))
    took = wait_for_replies(client, {"echo-a", "echo-b"})
    print(f"scale up seen in {took:.2f}s")

    (mesh_dir / "pod-a.yaml").unlink()
    took = wait_for_replies(client, {"echo-b"})
    print(f"scale down seen in {took:.2f}s")

    (mesh_dir / "svc.yaml").unlink()
    wait_for_replies(client, {"UNAVAILABLE"})
    line = client.next_json(5)
    assert "does not exist" in line["error"], line
    print(f"after deleting the Service: {line['error']}")


def test_short_host_forms_reach_the_same_service(
    mesh_dir: Path, echo_mesh: dict, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process]
) -> None:
    istiod = start_istiod(mesh_dir)
    for target in (f"xds:///echo.echo-ns:{SERVICE_PORT}", f"xds:///echo.echo-ns.svc:{SERVICE_PORT}"):
        client = start_demo("client", target, "--xds", istiod.xds_address, "--count", "3", name=target)
        assert client.next_json(15)["reply"].startswith("echo-a "), client.log()


def test_unknown_service_does_not_exist(
    mesh_dir: Path, echo_mesh: dict, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process]
) -> None:
    istiod = start_istiod(mesh_dir)
    # gRPC waits out its 15 s resource timer before calling a never-seen resource missing.
    client = start_demo("client", "xds:///nope.echo-ns.svc.cluster.local:7070", "--xds", istiod.xds_address,
                        "--count", "0", "--interval", "0.5", "--timeout", "2", name="client")
    line = wait_until(lambda: next((l for l in client.drain() if "does not exist" in l.get("error", "")), None),
                      25, "the client to call the listener missing")
    assert line["code"] == "UNAVAILABLE", line


def test_xds_enabled_server_gets_its_inbound_listener(
    mesh_dir: Path, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process]
) -> None:
    ip = "127.0.0.31"
    port = free_port(ip)
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="xecho", namespace="echo-ns", port=SERVICE_PORT))
    (mesh_dir / "pod.yaml").write_text(render("pod.yaml", pod="xecho-1", app="xecho", namespace="echo-ns", ip=ip, port=port))
    istiod = start_istiod(mesh_dir)
    server = start_demo("server", "--address", f"{ip}:{port}", "--name", "xecho-1", "--xds", istiod.xds_address,
                        "--namespace", "echo-ns", name="xds-server")
    assert server.next_json(15)["xds"] is True
    # The server serves only once it has its listener; a direct call and an xDS call both answer.
    direct = start_demo("client", f"{ip}:{port}", "--count", "20", "--interval", "0.25", name="direct")
    wait_until(lambda: any(l["ok"] for l in direct.drain()), 15, "the xDS server to serve")
    via_xds = start_client(start_demo, istiod, f"xds:///xecho.echo-ns.svc.cluster.local:{SERVICE_PORT}")
    wait_until(lambda: any(l["ok"] and l["reply"].startswith("xecho-1") for l in via_xds.drain()), 15, "an xDS call")
    status, syncz = istiod.get("/debug/syncz")
    server_sync = next(s for s in syncz if "xecho-1" in s["proxy"])
    assert server_sync["listener_sent"] and server_sync["listener_sent"] == server_sync["listener_acked"]


def test_bad_input_is_reported_and_skipped(
    mesh_dir: Path, echo_mesh: dict, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process]
) -> None:
    istiod = start_istiod(mesh_dir)
    client = start_client(start_demo, istiod, f"xds:///echo.echo-ns.svc.cluster.local:{SERVICE_PORT}")
    wait_until(lambda: any(l["ok"] for l in client.drain()), 15, "a first reply")
    for name, text in {
        "broken.yaml": "kind: Service\nmetadata: {name: [unclosed\n",
        "noname.yaml": "apiVersion: v1\nkind: Service\nmetadata: {namespace: echo-ns}\nspec: {ports: [{port: 80}]}\n",
        "badport.yaml": render("service.yaml", name="badport", namespace="echo-ns", port=70000),
        "badpv.yaml": "apiVersion: v1\nkind: PersistentVolume\nmetadata: {name: pv-bad}\nspec: {capacity: {storage: 10Gx}}\n",
    }.items():
        (mesh_dir / name).write_text(text)
    # A bad edit of a good object keeps its last good state too.
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="echo", namespace="echo-ns", port="-1"))
    expected = [
        "broken.yaml: while parsing a flow sequence",
        "keeping its last good objects",
        "noname.yaml object #1: Service has no metadata.name; skipped",
        "Service echo-ns/badport: spec.ports[0].port 70000 is not in 1-65535",
        "PersistentVolume pv-bad: spec.capacity.storage: quantity '10Gx' has an unknown suffix 'Gx'",
        "Service echo-ns/echo: spec.ports[0].port -1 is not in 1-65535",
    ]
    wait_until(lambda: all(e in istiod.text() for e in expected), 5, f"log lines {expected}")
    assert replies_from(client, 1.0) == {"echo-a"}
    status, services = istiod.get("/debug/registryz")
    assert [s["hostname"] for s in services] == ["echo.echo-ns.svc.cluster.local"]
    assert istiod.proc.poll() is None

"""A burst of 100 endpoint changes, each pushed only to the connections watching it, ends with every
real gRPC client and every real Envoy (state of the world and delta) on the final state."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import render
from tests.envoy_peer import Envoy, sidecar_envoy
from tests.peers import Istiod, Process, free_port, wait_until
from tests.test_envoy_sidecar import _dynamic
from tests.test_proxyless_grpc import SERVICE_PORT, start_client, wait_for_replies

ECHO = f"outbound|{SERVICE_PORT}||echo.echo-ns.svc.cluster.local"
OTHER = f"outbound|{SERVICE_PORT}||other.echo-ns.svc.cluster.local"
NOWHERE = "127.0.0.29"  # an address nothing listens on
CHANGES = 100


def _endpoints(envoy: Envoy) -> dict[str, set[str]] | None:
    """The Envoy's endpoints (address:port) of echo and other, once it holds both."""
    dump = envoy.config_dump()
    held = _dynamic(dump, "endpoints")
    if ECHO not in held or OTHER not in held:
        return None
    return {name: {f"{e['endpoint']['address']['socket_address']['address']}:"
                   f"{e['endpoint']['address']['socket_address']['port_value']}"
                   for group in held[name].get("endpoints", []) for e in group.get("lb_endpoints", [])}
            for name in (ECHO, OTHER)}


def test_a_burst_of_endpoint_changes_ends_on_the_final_state_everywhere(
    mesh_dir: Path, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process]
) -> None:
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    for name in ("echo", "other"):
        (mesh_dir / f"svc-{name}.yaml").write_text(render("service.yaml", name=name, namespace="echo-ns", port=SERVICE_PORT))
    backends: dict[str, tuple[str, int]] = {}
    for pod, ip in (("echo-a", "127.0.0.21"), ("echo-b", "127.0.0.22"), ("echo-c", "127.0.0.23")):
        backends[pod] = (ip, free_port(ip))
        start_demo("server", "--address", f"{ip}:{backends[pod][1]}", "--name", pod, name=pod).next_json(15)

    def write(pod: str, app: str, ip: str) -> None:
        (mesh_dir / f"pod-{pod}.yaml").write_text(
            render("pod.yaml", pod=pod, app=app, namespace="echo-ns", ip=ip, port=backends.get(pod, (ip, 7070))[1]))

    for pod, (ip, _) in backends.items():
        write(pod, "echo", ip)
    write("other-1", "other", "127.0.0.41")
    istiod = start_istiod(mesh_dir)
    clients = [start_client(start_demo, istiod, f"xds:///echo.echo-ns.svc.cluster.local:{SERVICE_PORT}")
               for _ in range(2)]
    with sidecar_envoy(istiod.xds_address, "web-1", "echo-ns", "127.0.0.31") as sotw, \
            sidecar_envoy(istiod.xds_address, "web-2", "echo-ns", "127.0.0.32", delta=True) as delta:
        envoys = {"the SotW Envoy": sotw, "the delta Envoy": delta}
        for name, envoy in envoys.items():
            wait_until(lambda: _endpoints(envoy), 20, f"{name} to hold echo's and other's endpoints")
        for client in clients:
            wait_for_replies(client, {"echo-a", "echo-b", "echo-c"}, timeout=20)

        # Echo's pods move, leave and come back; other's pod moves, in between: 100 writes, ~40 pushes.
        rng = random.Random(12)
        for i in range(CHANGES - 4):
            pod = rng.choice([*backends, "other-1"])
            if pod == "other-1":
                write(pod, "other", f"127.0.0.{rng.randint(41, 49)}")
            else:
                write(pod, rng.choice(("echo", "idle")), rng.choice((backends[pod][0], NOWHERE)))
            time.sleep(0.025)
        write("echo-a", "idle", backends["echo-a"][0])
        write("echo-b", "echo", backends["echo-b"][0])
        write("echo-c", "echo", backends["echo-c"][0])
        write("other-1", "other", "127.0.0.42")

        final = {ECHO: {"%s:%d" % backends[p] for p in ("echo-b", "echo-c")}, OTHER: {"127.0.0.42:7070"}}
        for name, envoy in envoys.items():
            _wait_for(name, envoy, final)
        for client in clients:
            wait_for_replies(client, {"echo-b", "echo-c"}, timeout=10)


def _wait_for(name: str, envoy: Envoy, final: dict[str, set[str]]) -> None:
    try:
        wait_until(lambda: _endpoints(envoy) == final, 10, f"{name} to hold the final endpoints")
    except AssertionError:
        raise AssertionError(f"{name} holds {_endpoints(envoy)}, expected {final}") from None


from __future__ import annotations

import logging
import string
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ads_client import AdsClient
from tests.peers import Istiod, Process, agent, demo, free_port, wait_until

DATA = Path(__file__).parent / "data"


def render(template: str, **values: object) -> str:
    """A YAML fixture from tests/data with $placeholders filled in."""
    return string.Template((DATA / template).read_text()).substitute({k: str(v) for k, v in values.items()})


@pytest.fixture(autouse=True)
def _root_logger() -> Iterator[None]:
    """The CLI run in-process points the root logger at this test's captured stderr, which pytest
    closes after the test: later tests' records would each print a logging error."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def mesh_dir(tmp_path: Path) -> Path:
    path = tmp_path / "mesh"
    path.mkdir()
    return path


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in reversed(started):
        process.stop()


@pytest.fixture
def start_istiod(tmp_path: Path, processes: list[Process]) -> Callable[..., Istiod]:
    def start(config_dir: Path, *extra: str, log_format: str = "kv", env: dict[str, str] | None = None,
              open_files: int | None = None) -> Istiod:
        istiod = Istiod(tmp_path, "--config-dir", str(config_dir), "--poll-interval", "100ms", *extra,
                        log_format=log_format, env=env, open_files=open_files)
        processes.append(istiod)
        return istiod

    return start


@pytest.fixture
def start_demo(processes: list[Process]) -> Callable[..., Process]:
    def start(*args: str, env: dict[str, str] | None = None, name: str = "") -> Process:
        process = demo(*args, env=env, name=name)
        processes.append(process)
        return process

    return start


@pytest.fixture
def start_agent(processes: list[Process]) -> Callable[..., Process]:
    def start(*args: str, name: str = "agent") -> Process:
        process = agent(*args, name=name)
        processes.append(process)
        return process

    return start


@pytest.fixture
async def ads_client() -> AsyncIterator[Callable[..., AdsClient]]:
    """Hand-written ADS clients in the test process, closed after the test."""
    clients: list[AdsClient] = []

    def connect(istiod: Istiod, pod: str, namespace: str, ip: str = "127.0.0.1", istio_version: str = "") -> AdsClient:
        node_id = f"sidecar~{ip}~{pod}.{namespace}~{namespace}.svc.cluster.local"
        client = AdsClient(istiod.xds_address, node_id, namespace, istio_version)
        clients.append(client)
        return client

    yield connect
    for client in clients:
        await client.close()


ECHO_HOST = "echo.echo-ns.svc.cluster.local"
ECHO_PORT = 7070
CLIENT_PROXY = "sidecar~127.0.0.1~demo-client.echo-ns~echo-ns.svc.cluster.local"
SERVER_PROXY = "sidecar~127.0.0.21~echo-a.echo-ns~echo-ns.svc.cluster.local"


@dataclass
class Mesh:
    dir: Path
    istiod: Istiod
    client: Process  # a real grpcio xDS client calling echo
    server: Process  # a real xDS-enabled grpcio server: pod echo-a
    server_port: int  # echo-a's container port, on 127.0.0.21


def synced(istiod: Istiod, proxy: str, prefixes: tuple[str, ...]) -> bool:
    """Whether /debug/syncz shows `proxy` with every type in `prefixes` sent and ACKed."""
    status, syncz = istiod.get("/debug/syncz")
    entry = next((s for s in syncz if s["proxy"] == proxy), None) if status == 200 else None
    return entry is not None and all(entry[f"{p}_sent"] and entry[f"{p}_sent"] == entry[f"{p}_acked"]
                                     for p in prefixes)


@pytest.fixture
def istiod_args() -> tuple[str, ...]:
    """Flags of synced_mesh's istiod (a module overrides this fixture to run its tests so)."""
    return ()


@pytest.fixture
def synced_mesh(mesh_dir: Path, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process],
                istiod_args: tuple[str, ...]) -> Mesh:
    """Namespace echo-ns: Service echo with pod echo-a served by an xDS-enabled server, a CronJob's
    finished pod with a PersistentVolume, and an xDS client calling echo; both proxies synced."""
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="echo", namespace="echo-ns", port=ECHO_PORT))
    (mesh_dir / "batch.yaml").write_text(render("batch.yaml", namespace="echo-ns"))
    ip, port = "127.0.0.21", free_port("127.0.0.21")
    (mesh_dir / "pod-a.yaml").write_text(render("pod.yaml", pod="echo-a", app="echo", namespace="echo-ns", ip=ip, port=port))
    istiod = start_istiod(mesh_dir, *istiod_args)
    server = start_demo("server", "--address", f"{ip}:{port}", "--name", "echo-a", "--xds", istiod.xds_address,
                        "--namespace", "echo-ns", name="echo-a")
    client = start_demo("client", f"xds:///{ECHO_HOST}:{ECHO_PORT}", "--xds", istiod.xds_address, "--count", "0",
                        "--interval", "0.1", "--timeout", "1", "--namespace", "echo-ns", name="client")
    wait_until(lambda: any(line["ok"] for line in client.drain()), 20, "the client's first reply")
    wait_until(lambda: synced(istiod, CLIENT_PROXY, ("cluster", "listener", "endpoint", "route"))
               and synced(istiod, SERVER_PROXY, ("listener",)), 10, "both proxies to be synced")
    return Mesh(mesh_dir, istiod, client, server, port)

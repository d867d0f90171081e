"""istio-cni pieces at their boundaries: the ZDS server against a hostile ZDS client, the CNI plugin
run as a runtime runs it on bad input, the plugin endpoint, the CNI config chaining, the rules and
Istio's ambient membership rules. The real ztunnel is in tests/test_cni_ztunnel.py."""

from __future__ import annotations

import array
import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from istiod.cni import redirect
from istiod.cni.agent import NodeAgent
from istiod.cni.install import CniConfigError, CniInstall, chained
from istiod.cni.membership import node_pods
from istiod.cni.pluginevents import EVENT_SOCKET, serve
from istiod.cni.zds import ZdsError, ZdsServer, ZdsWorkload
from istiod.gen.istio.workload.zds import zds_pb2
from istiod.sources.store import Store
from tests.peers import ROOT

# ztunnel's source, beside the checkout as tests/ztunnel_peer.py finds its build script.
ZTUNNEL_SOURCE = next((p / "shared" / "ztunnel" / "ztunnel-src.tar.gz" for p in ROOT.parents
                       if (p / "shared" / "ztunnel" / "ztunnel-src.tar.gz").exists()), None)


class Pods:
    def __init__(self, *workloads: ZdsWorkload) -> None:
        self.workloads = list(workloads)
        self.results: dict[str, str] = {}

    def snapshot(self) -> list[ZdsWorkload]:
        return list(self.workloads)

    def handed(self, uid: str, error: str) -> None:
        self.results[uid] = error


class Client:
    """A ZDS client speaking raw packets, as ztunnel's side of the socket."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.setblocking(False)
        self.path = path

    async def connect(self) -> None:
        await asyncio.get_running_loop().sock_connect(self.sock, str(self.path))

    async def send(self, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def hello(self) -> None:
        await self.send(zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString())

    async def receive(self, timeout: float = 5) -> tuple[zds_pb2.WorkloadRequest, list[int]]:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(self.sock, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, timeout)
        finally:
            loop.remove_reader(self.sock)
        data, ancillary, _, _ = self.sock.recvmsg(1024, socket.CMSG_SPACE(4 * 4))
        fds = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % 4])
        return zds_pb2.WorkloadRequest.FromString(data), list(fds)

    async def ack(self, error: str = "") -> None:
        await self.send(zds_pb2.WorkloadResponse(ack=zds_pb2.Ack(error=error)).SerializeToString())

    async def closed(self, timeout: float = 5) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            try:
                if self.sock.recv(1024) == b"":
                    return True
            except BlockingIOError:
                await asyncio.sleep(0.02)
            except ConnectionResetError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
async def zds(tmp_path: Path) -> AsyncIterator[tuple[ZdsServer, Pods]]:
    pods = Pods(ZdsWorkload("uid-1", "one", "demo", "sa", "/proc/self/ns/net"))
    server = ZdsServer(tmp_path / "zds.sock", ack_timeout=0.5)
    task = asyncio.create_task(server.run(pods))
    while not server.path.exists():
        await asyncio.sleep(0.01)
    yield server, pods
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not server.path.exists()


async def connected(server: ZdsServer, client: Client) -> None:
    """The snapshot (one add, then snapshot_sent) taken and acked."""
    await client.connect()
    await client.hello()
    request, fds = await client.receive()
    assert request.WhichOneof("payload") == "add" and len(fds) == 1
    # The fd is the named network namespace: same inode as the file the agent opened.
    assert os.fstat(fds[0]).st_ino == os.stat("/proc/self/ns/net").st_ino
    os.close(fds[0])
    await client.ack()
    request, fds = await client.receive()
    assert request.WhichOneof("payload") == "snapshot_sent" and not fds
    await client.ack()
    for _ in range(100):
        if server.connected:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server never counted the client as connected")


async def test_zds_snapshot_then_adds_and_deletes_each_acked(zds: tuple[ZdsServer, Pods]) -> None:
    server, pods = zds
    client = Client(server.path)
    try:
        await connected(server, client)
        assert pods.results == {"uid-1": ""}
        add = asyncio.create_task(server.add(ZdsWorkload("uid-2", "two", "demo", "sa", "/proc/self/ns/net")))
        request, fds = await client.receive()
        assert request.add.uid == "uid-2" and request.add.workload_info.name == "two" and len(fds) == 1
        os.close(fds[0])
        assert not add.done()  # waits for the Ack
        await client.ack()
        await add
        delete = asyncio.create_task(server.delete("uid-2"))
        request, fds = await client.receive()
        assert getattr(request, "del").uid == "uid-2" and not fds
        await client.ack("no such workload")
        with pytest.raises(ZdsError, match="ztunnel refused del: no such workload"):
            await delete
        assert server.connected  # a refusal is an answer: the connection stays
    finally:
        client.close()


@pytest.mark.parametrize("hello, error", [
    (b"\xff\xff\xff\xff", "malformed hello"),
    (zds_pb2.ZdsHello(version=zds_pb2.NOT_USED).SerializeToString() + b"\x08\x07", "unsupported version 7"),
    (None, "no hello within 0.5s"),
])
async def test_zds_bad_hello_drops_only_that_client(zds: tuple[ZdsServer, Pods], hello: bytes | None, error: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    server, _ = zds
    bad, good = Client(server.path), Client(server.path)
    try:
        await bad.connect()
        if hello is not None:
            await bad.send(hello)
        assert await bad.closed()
        assert error in caplog.text and "Traceback" not in caplog.text
        await connected(server, good)
    finally:
        bad.close()
        good.close()


@pytest.mark.parametrize("reply, error", [
    (b"\xff\xff", "malformed reply to add"),
    (b"\x12\x00", "reply to add is not an Ack"),  # a WorkloadResponse with only an unknown field 2
    (b"", "closed the connection during add"),  # a zero-length packet reads as the end
    (None, "did not ack add within 0.5s"),
])
async def test_zds_bad_or_missing_ack_disconnects_and_the_next_ztunnel_gets_the_snapshot(
        zds: tuple[ZdsServer, Pods], reply: bytes | None, error: str) -> None:
    server, pods = zds
    broken, fresh = Client(server.path), Client(server.path)
    try:
        await connected(server, broken)
        add = asyncio.create_task(server.add(ZdsWorkload("uid-2", "two", "demo", "sa", "/proc/self/ns/net")))
        _, fds = await broken.receive()
        for fd in fds:
            os.close(fd)
        if reply is not None:
            await broken.send(reply)
        with pytest.raises(ZdsError, match=error):
            await add
        assert not server.connected and await broken.closed()
        with pytest.raises(ZdsError, match="no ztunnel connected"):
            await server.delete("uid-1")
        await connected(server, fresh)
    finally:
        broken.close()
        fresh.close()


async def test_zds_snapshot_skips_a_pod_whose_namespace_vanished(zds: tuple[ZdsServer, Pods]) -> None:
    server, pods = zds
    pods.workloads.insert(0, ZdsWorkload("uid-0", "gone", "demo", "sa", "/var/run/netns/sp-no-such-namespace"))
    client = Client(server.path)
    try:
        await connected(server, client)  # only uid-1's add came, then snapshot_sent
        assert pods.results["uid-1"] == ""
        assert "sp-no-such-namespace: No such file or directory" in pods.results["uid-0"]
    finally:
        client.close()


async def test_zds_snapshot_follows_pods_captured_and_released_meanwhile(zds: tuple[ZdsServer, Pods]) -> None:
    server, pods = zds
    client = Client(server.path)
    try:
        await client.connect()
        await client.hello()
        request, fds = await client.receive()
        assert request.add.uid == "uid-1"
        os.close(fds[0])
        # While ztunnel works on uid-1: the agent released it and captured uid-3.
        pods.workloads = [ZdsWorkload("uid-3", "three", "demo", "sa", "/proc/self/ns/net")]
        await client.ack()
        request, fds = await client.receive()
        assert getattr(request, "del").uid == "uid-1" and not fds
        await client.ack()
        request, fds = await client.receive()
        assert request.add.uid == "uid-3" and len(fds) == 1
        os.close(fds[0])
        await client.ack()
        request, _ = await client.receive()
        assert request.WhichOneof("payload") == "snapshot_sent"
    finally:
        client.close()


def test_redirection_rules_are_ztunnels() -> None:
    """Every rule of ztunnel's scripts/ztunnel-redirect-inpod.sh, in its order, for its tables."""
    assert ZTUNNEL_SOURCE is not None, "no shared/ztunnel/ztunnel-src.tar.gz beside the checkout"
    with tarfile.open(ZTUNNEL_SOURCE) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("scripts/ztunnel-redirect-inpod.sh"))
        script = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
    restore = script.split("<<EOF\n", 1)[1].split("\nEOF", 1)[0]

    def rules(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(("*", "-A", "COMMIT", ":ISTIO"))]

    assert rules(redirect.render(dns_capture=True)) == rules(restore)
    assert not any("15053" in line for line in rules(redirect.render(dns_capture=False)))


# The CNI plugin, run as the runtime runs it.
PREV = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0"}], "ips": [{"address": "10.9.0.2/16", "interface": 0}]}


def run_plugin(command: str, stdin: Any, **env: str) -> tuple[int, Any]:
    environ = {**os.environ, "CNI_COMMAND": command, "CNI_CONTAINERID": "c0ffee", "CNI_NETNS": "/var/run/netns/x",
               "CNI_IFNAME": "eth0", "CNI_PATH": "/opt/cni/bin", "CNI_ARGS": "K8S_POD_NAMESPACE=demo;K8S_POD_NAME=p",
               **env}
    environ = {k: v for k, v in environ.items() if v != "-"}  # "-" unsets
    done = subprocess.run([str(Path(sys.executable).parent / "istio-cni")], env=environ, capture_output=True,
                          text=True, timeout=30, cwd=ROOT, input=stdin if isinstance(stdin, str) else json.dumps(stdin))
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else None


def entry(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"cniVersion": "1.0.0", "name": "net", "type": "istio-cni", "cni_agent_run_dir": str(tmp_path),
            "exclude_namespaces": ["kube-system"], "prevResult": PREV, **extra}


def test_plugin_version() -> None:
    code, out = run_plugin("VERSION", {"cniVersion": "0.4.0"})
    assert code == 0 and out["cniVersion"] == "0.4.0" and "1.0.0" in out["supportedVersions"]


@pytest.mark.parametrize("command, stdin, env, want_code, want_msg", [
    ("ADD", "{not json", {}, 6, "not JSON"),
    ("ADD", "[1]", {}, 6, "not a JSON object"),
    ("ADD", {"type": "istio-cni"}, {}, 7, "no cniVersion"),
    ("ADD", {"cniVersion": "9.9.9"}, {}, 1, "cniVersion 9.9.9 is not supported"),
    ("ADD", "entry-without-prev", {}, 7, "must be chained"),
    ("ADD", "entry", {"CNI_NETNS": "-"}, 4, "CNI_NETNS is not set"),
    ("ADD", "entry", {}, 11, "node agent at"),  # no agent on the socket
    ("DEL", "entry", {"CNI_CONTAINERID": "-"}, 4, "CNI_CONTAINERID is not set"),
    ("CHECK", "entry-without-prev", {}, 7, "must be chained"),
    ("FROB", "entry", {}, 4, "CNI_COMMAND 'FROB'"),
])
def test_plugin_errors_are_cni_error_json(tmp_path: Path, command: str, stdin: Any, env: dict[str, str],
                                          want_code: int, want_msg: str) -> None:
    if stdin == "entry":
        stdin = entry(tmp_path)
    elif stdin == "entry-without-prev":
        stdin = {k: v for k, v in entry(tmp_path).items() if k != "prevResult"}
    code, out = run_plugin(command, stdin, **env)
    assert code == 1 and out["code"] == want_code and want_msg in out["msg"], out


@pytest.mark.parametrize("args", ["K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=dns", "IgnoreUnknown=1"])
def test_plugin_passes_through_excluded_and_non_kubernetes_sandboxes(tmp_path: Path, args: str) -> None:
    code, out = run_plugin("ADD", entry(tmp_path, cniVersion="0.4.0"), CNI_ARGS=args)
    assert code == 0 and out == {**PREV, "cniVersion": "0.4.0"}


def test_plugin_del_succeeds_without_an_agent(tmp_path: Path) -> None:
    assert run_plugin("DEL", entry(tmp_path)) == (0, None)


# The agent's endpoint for the plugin, on bad requests.
class NoZtunnel:
    connected = False

    async def add(self, workload: ZdsWorkload) -> None:
        raise ZdsError("no ztunnel connected")

    async def delete(self, uid: str) -> None:
        raise ZdsError("no ztunnel connected")


async def test_plugin_endpoint_refuses_bad_events(tmp_path: Path) -> None:
    store = Store()
    store.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "demo"},
                 "spec": {"nodeName": "n1", "containers": []}})
    agent = NodeAgent("n1", store, NoZtunnel(), None, tmp_path, pod_wait=0.2)
    runner = await serve(agent, tmp_path / EVENT_SOCKET)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(tmp_path / EVENT_SOCKET))) as http:
            async def post(path: str, body: bytes) -> tuple[int, str]:
                async with http.post(f"http://agent{path}", data=body) as reply:
                    return reply.status, await reply.text()

            assert await post("/cmdadd", b"{") == (400, "cmdadd: body is not JSON: Expecting property name enclosed "
                                                         "in double quotes: line 1 column 2 (char 1)")
            assert await post("/cmdadd", b"[]") == (400, "cmdadd: body is not a JSON object")
            assert await post("/cmdadd", b'{"PodName": "p", "PodNamespace": 3}') == (
                400, "cmdadd: missing or not a string: Netns, PodNamespace")
            status, text = await post("/cmdadd", json.dumps({"Netns": "/proc/self/ns/net", "PodName": "q",
                                                              "PodNamespace": "demo"}).encode())
            assert (status, text) == (500, "pod demo/q is not known on node n1 after 0.2s")
            # Known but not ambient: nothing to do, and said so.
            status, text = await post("/cmdadd", json.dumps({"Netns": "/proc/self/ns/net", "PodName": "p",
                                                              "PodNamespace": "demo"}).encode())
            assert (status, json.loads(text)) == (200, {"captured": False})
            status, text = await post("/cmddel", json.dumps({"PodName": "p", "PodNamespace": "demo"}).encode())
            assert (status, json.loads(text)) == (200, {"released": False})
    finally:
        await runner.cleanup()


# Chaining into the CNI config.
def install(tmp_path: Path, name: str = "") -> CniInstall:
    return CniInstall(tmp_path, name, None, (("cni_agent_run_dir", "/run/x"),))


def test_chaining_into_a_conflist_is_atomic_idempotent_and_undone(tmp_path: Path) -> None:
    primary = tmp_path / "10-net.conflist"
    (tmp_path / "99-other.conflist").write_text("{}")
    original = {"cniVersion": "1.0.0", "name": "net", "plugins": [{"type": "bridge"}, {"type": "istio-cni", "old": 1}]}
    primary.write_text(json.dumps(original))
    assert install(tmp_path).install() == primary
    plugins = json.loads(primary.read_text())["plugins"]
    assert plugins == [{"type": "bridge"}, {"type": "istio-cni", "cni_agent_run_dir": "/run/x"}]
    inode = primary.stat().st_ino
    install(tmp_path).install()
    assert primary.stat().st_ino == inode  # nothing to change: not rewritten
    install(tmp_path).uninstall()
    assert json.loads(primary.read_text())["plugins"] == [{"type": "bridge"}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["10-net.conflist", "99-other.conflist"]  # no staging left


def test_a_single_plugin_conf_becomes_a_conflist(tmp_path: Path) -> None:
    (tmp_path / "10-net.conf").write_text(json.dumps({"cniVersion": "0.4.0", "name": "net", "type": "bridge"}))
    assert install(tmp_path, "10-net.conf").install() == tmp_path / "10-net.conflist"
    assert not (tmp_path / "10-net.conf").exists()
    config = json.loads((tmp_path / "10-net.conflist").read_text())
    assert config["cniVersion"] == "0.4.0" and config["name"] == "net"
    assert [p["type"] for p in config["plugins"]] == ["bridge", "istio-cni"]
    assert install(tmp_path, "10-net.conf").primary() == tmp_path / "10-net.conflist"  # found under its new name


def test_chaining_waits_for_a_config_and_refuses_a_broken_one(tmp_path: Path) -> None:
    assert install(tmp_path).install() is None
    (tmp_path / "10-net.conflist").write_text("{broken")
    with pytest.raises(CniConfigError, match="10-net.conflist"):
        install(tmp_path).install()
    (tmp_path / "10-net.conflist").write_text('{"name": "x"}')
    with pytest.raises(CniConfigError, match="neither a plugin list"):
        install(tmp_path).install()
    assert chained({"plugins": []}, {"type": "istio-cni"}) == {"plugins": [{"type": "istio-cni"}]}


# Istio's ambient membership.
def pod(name: str, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        node: str = "n1", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}",
                                                             "labels": labels or {}, "annotations": annotations or {}},
            "spec": {"nodeName": node, "containers": [], **spec}, "status": {"phase": "Running", "podIP": "10.0.0.1"}}


def test_ambient_membership_follows_istios_rules() -> None:
    for labels in ({}, {"istio.io/dataplane-mode": "ambient"}):
        store = Store()
        store.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns", "labels": labels}})
        for body in (
            pod("plain"),
            pod("in", {"istio.io/dataplane-mode": "ambient"}),
            pod("out", {"istio.io/dataplane-mode": "none"}),
            pod("sidecar", {"istio.io/dataplane-mode": "ambient"}, {"sidecar.istio.io/status": "{}"}),
            pod("host", {"istio.io/dataplane-mode": "ambient"}, hostNetwork=True),
            pod("marked", annotations={"ambient.istio.io/redirection": "enabled"}),
            pod("elsewhere", {"istio.io/dataplane-mode": "ambient"}, node="n2"),
        ):
            store.apply(body)
        pods = node_pods(store, "n1")
        ambient = {name for (_, name), p in pods.items() if p.ambient}
        assert "elsewhere" not in {name for _, name in pods}
        assert pods[("ns", "marked")].annotated and not pods[("ns", "plain")].annotated
        assert pods[("ns", "in")].uid == "u-in"
        assert ambient == ({"in", "plain", "marked"} if labels else {"in"})


def test_plugin_module_loads_only_the_standard_library() -> None:
    """The runtime starts the plugin for every pod: it must not pull in the control plane."""
    code = "import sys, istiod.cni.plugin; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('grpc', 'google', 'kubernetes_asyncio', 'aiohttp', 'yaml')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr



@pytest.mark.parametrize("args, env, message", [
    ([], {"NODE_NAME": ""}, "istiod cni: --node-name (or $NODE_NAME) is required"),
    (["--node-name", "n1", "--config-dir", "/nonexistent-dir"], {}, "--config-dir /nonexistent-dir: no such directory"),
    (["--node-name", "n1", "--zds-ack-timeout", "5"], {}, "duration '5' must be a number with a unit"),
    (["--node-name", "n1", "--ambient-dns-capture", "maybe"], {}, "'maybe' must be true or false"),
])
def test_cni_command_line_mistakes_are_one_line(args: list[str], env: dict[str, str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "istiod", "cni", *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=30, cwd=ROOT)
    assert done.returncode != 0 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_cni_agent_that_cannot_serve_its_socket_says_so(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "config").mkdir()
    done = subprocess.run([sys.executable, "-m", "istiod", "cni", "--node-name", "n1", "--config-dir",
                           str(tmp_path / "config"), "--cni-agent-run-dir", str(tmp_path / "file" / "run"),
                           "--ztunnel-uds-address", str(tmp_path / "zds.sock"), "--mounted-cni-net-dir",
                           str(tmp_path / "net.d"), "--cni-bin-dir", ""],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert "istio-cni node agent: [Errno 20] Not a directory" in done.stderr and "Traceback" not in done.stderr

"""Pods as network namespaces, for the sidecar demo and the traffic tests (root only).

A "node" namespace holds a bridge; each pod is a namespace with a veth pair to that bridge and a
10.x address that exists only in these namespaces. The root namespace is not touched: both ends of
each veth are created directly inside the namespaces. `ip netns exec` bind-mounts
/etc/netns/<name>/hosts over /etc/hosts, which is how a pod resolves service names to VIPs.
Namespace names are `sp-<pid>-<name>`, so a sweep can remove those of processes that are gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from istiod.model.names import split_host_port

PREFIX = "sp-"
NETNS_ETC = Path("/etc/netns")
ENVOY_UID = 1337  # istio-proxy's uid and gid, exempt from capture
POD_PREFIX_LENGTH = 16  # pods and the node share one 10.x/16
_OWNED = re.compile(rf"^{PREFIX}(\d+)-")


def missing_privileges() -> str:
    """Why pods cannot be made here, or '' when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run as root, as CI does)"
    for tool in ("ip", "iptables-restore", "setpriv", "curl"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian's iproute2, iptables, util-linux, curl: make netns-tools)"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Netns:
    """A network namespace this process created; `exec_args` runs a command inside it."""

    def __init__(self, name: str, hosts: dict[str, str] | None = None) -> None:
        self.name = f"{PREFIX}{os.getpid()}-{name}"
        _ip("netns", "add", self.name)
        try:
            _ip("-n", self.name, "link", "set", "lo", "up")
            if hosts is not None:
                self.write_hosts(hosts)
        except BaseException:
            self.delete()
            raise

    def write_hosts(self, hosts: dict[str, str]) -> None:
        """/etc/hosts as seen inside: each name -> address (service names -> VIPs)."""
        directory = NETNS_ETC / self.name
        directory.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{address} {name}" for name, address in hosts.items()]
        (directory / "hosts").write_text("\n".join(lines) + "\n")

    def exec_args(self, *command: str, uid: int | None = None) -> list[str]:
        """`command` inside the namespace, as `uid` (and the same gid, no other groups) if given."""
        user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
        return ["ip", "netns", "exec", self.name, *user, *command]

    def run(self, *command: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.exec_args(*command), capture_output=True, text=True, timeout=timeout)

    def delete(self) -> None:
        delete_netns(self.name)


def delete_netns(name: str) -> None:
    """Remove a namespace (its veth ends go with it) and its /etc/netns files; absent is fine.

    A process still inside (an Envoy whose agent was killed before it could stop it) would keep
    the namespace alive unseen, so each is killed first, by its pid."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def sweep() -> list[str]:
    """Delete `sp-` namespaces left by processes that no longer run (a killed test run)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    removed = []
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        owner = _OWNED.match(name)
        if owner and not _alive(int(owner.group(1))):
            delete_netns(name)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Node:
    """The node: a namespace with a bridge that every pod's veth is plugged into."""

    def __init__(self, subnet: str = "10.44", name: str = "node") -> None:
        self.subnet = subnet
        self.pods: list[Netns] = []
        self.ns = Netns(name)
        try:
            _ip("-n", self.ns.name, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.ns.name, "addr", "add", f"{subnet}.0.1/{POD_PREFIX_LENGTH}", "dev", "br0")
            _ip("-n", self.ns.name, "link", "set", "br0", "up")
            # An address that is nowhere (a deleted Service's VIP) is refused at once, not a timeout.
            _ip("-n", self.ns.name, "route", "add", "unreachable", "default")
            subprocess.run(self.ns.exec_args("sysctl", "-qw", "net.ipv4.ip_forward=1"), check=True, timeout=30)
        except BaseException:
            self.ns.delete()
            raise

    def add_pod(self, name: str, host: int, hosts: dict[str, str] | None = None) -> Netns:
        """A pod namespace with `eth0` at <subnet>.0.<host> and a default route out of it."""
        pod = Netns(name, hosts)
        self.pods.append(pod)
        ip = self.pod_ip(host)
        port = f"veth{len(self.pods)}"  # interface names are at most 15 characters
        _ip("link", "add", "eth0", "netns", pod.name, "type", "veth", "peer", "name", port, "netns", self.ns.name)
        _ip("-n", self.ns.name, "link", "set", port, "master", "br0", "up")
        _ip("-n", pod.name, "addr", "add", f"{ip}/{POD_PREFIX_LENGTH}", "dev", "eth0")
        _ip("-n", pod.name, "link", "set", "eth0", "up")
        # Service VIPs are outside the subnet: a route must exist before iptables can redirect them.
        _ip("-n", pod.name, "route", "add", "default", "via", f"{self.subnet}.0.1")
        return pod

    def pod_ip(self, host: int) -> str:
        return f"{self.subnet}.0.{host}"

    def delete(self) -> None:
        for pod in reversed(self.pods):
            pod.delete()
        self.pods.clear()
        self.ns.delete()



ISTIOD_IN_POD = "127.0.0.1:15012"  # where a pod's agent finds istiod: the tunnel's end in the pod


@dataclass(frozen=True, slots=True)
class Sidecar:
    """A pod's istio-proxy container: the agent and Envoy run inside the pod as uid 1337, with their
    files under `home` (token, root certificate, certificates, Envoy's working directory)."""

    pod: Netns
    home: Path
    name: str
    namespace: str
    service_account: str
    ip: str

    def prepare(self, root_cert: Path, token: str) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root_cert, self.home / "root-cert.pem")
        (self.home / "token").write_text(token)
        for path in (self.home, *self.home.rglob("*")):
            os.chown(path, ENVOY_UID, ENVOY_UID)

    def capture_command(self) -> list[str]:
        """istio-init's job, as root inside the pod."""
        return self.pod.exec_args(sys.executable, "-m", "istiod", "agent", "iptables")

    def tunnel_command(self, istiod: str) -> list[str]:
        return [sys.executable, "-m", "istiod.demo.pods", "tunnel", "--netns", self.pod.name,
                "--listen", ISTIOD_IN_POD, "--to", istiod]

    def agent_command(self, *extra: str) -> list[str]:
        home = self.home
        return self.pod.exec_args(
            sys.executable, "-m", "istiod", "agent", "--ca-addr", ISTIOD_IN_POD,
            "--ca-root-cert", str(home / "root-cert.pem"), "--token-file", str(home / "token"),
            "--output-dir", str(home / "certs"), "--bootstrap", str(home / "grpc-bootstrap.json"),
            "--pod-name", self.name, "--pod-namespace", self.namespace, "--instance-ip", self.ip,
            "--service-account", self.service_account,
            "proxy", "--workdir", str(home), *extra, uid=ENVOY_UID)


class Tunnel:
    """Pods reach istiod as a Service, which on loopback they cannot: this listens on an address
    inside a pod's namespace and forwards each connection to an address in this process's own
    namespace (istiod's port on the host's loopback). Run it as `python -m istiod.demo.pods tunnel`."""

    def __init__(self, netns: str, listen: tuple[str, int], upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        own = os.open("/proc/self/ns/net", os.O_RDONLY)
        try:
            _setns(f"/var/run/netns/{netns}")
            try:
                self.sock = socket.create_server(listen)
            finally:
                _setns_fd(own)  # a socket keeps the namespace it was made in
        finally:
            os.close(own)

    async def serve(self) -> None:
        server = await asyncio.start_server(self._forward, sock=self.sock)
        print(json.dumps({"serving": "%s:%d" % self.sock.getsockname()[:2], "to": "%s:%d" % self.upstream}), flush=True)
        await server.serve_forever()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


_CLONE_NEWNET = 0x40000000


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _setns_fd(fd)
    finally:
        os.close(fd)


def _setns_fd(fd: int) -> None:
    """setns(2) for this thread (os.setns arrives with Python 3.12)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns: {os.strerror(error)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m istiod.demo.pods")
    commands = parser.add_subparsers(dest="command", required=True)
    tunnel = commands.add_parser("tunnel", help="forward from an address inside a namespace to one outside")
    tunnel.add_argument("--netns", required=True)
    tunnel.add_argument("--listen", required=True, type=split_host_port)
    tunnel.add_argument("--to", required=True, type=split_host_port)
    args = parser.parse_args(argv)
    asyncio.run(Tunnel(args.netns, args.listen, args.to).serve())


if __name__ == "__main__":
    main()

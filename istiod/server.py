"""Assembles istiod's parts, runs them, and shuts them down in order."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import signal
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from typing import Any

import grpc
import uvicorn
from envoy.service.discovery.v3 import ads_pb2
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from kubernetes_asyncio import client
from kubernetes_asyncio.config import ConfigException
import yaml

from istiod import logs
from istiod.debug.access import AccessPolicy
from istiod.ca.publisher import ELECTION, RootCertPublisher
from istiod.status.analysis import ELECTION as ANALYSIS_ELECTION, AnalysisController
from istiod.connlimit import MAX_CONNECTIONS, raise_open_file_limit, sized_cap
from istiod.debug.app import DebugView, create_app
from istiod.debug.connections import Question, answer
from istiod.debug.serving import guarded_config
from istiod.autoregistration import WorkloadEntryController
from istiod.gatewaynames import GatewayNameResolver
from istiod.kubeapi import api_client
from istiod.kubeentries import KubeEntryStore
from istiod.leader import LeaderElection
from istiod.status.gateway_api import GatewayStatusWriter
from istiod.status.gateway_deployment import GatewayDeployer
from istiod.listen import listen_tcp
from istiod.memory import settle_heap, trim_when_free
from istiod.model.mesh import MeshConfig
from istiod.model.names import join_host_port
from istiod.revision import injector_configmap, mesh_configmap
from istiod.secure import SecurePort
from istiod.settings import Address, Settings
from istiod.sources.configdir import ConfigDirSource
from istiod.sources.monitoring import record_change
from istiod.sources.kube import KubeSource
from istiod.jwks import JwksResolver
from istiod.sources.meshconfig import (MeshConfigMapWatcher, MeshFileWatcher, MeshNetworks, read_mesh_file,
                                       read_mesh_networks_file)
from istiod.sources.namespaces import NamespaceFilter, parse_selector
from istiod.sources.store import Store
from istiod.supervisor import Supervisor
from istiod.webhooks.cabundle import CaBundlePatcher
from istiod.webhooks.injection import InjectionError, Injector
from istiod.webhooks.injector_source import InjectorConfigMapWatcher, read_injection_dir
from istiod.webhooks.serve import WebhookServer
from istiod.xds.debugtypes import DebugTypes, control_plane_identifier
from istiod.xds.pusher import Pusher
from istiod.xds.server import DiscoveryServer
from istiod.xds.workers import WorkerPool, ads_server

log = logging.getLogger(__name__)
ADS_SERVICE = ads_pb2.DESCRIPTOR.services_by_name["AggregatedDiscoveryService"].full_name
# Fds one more connection on each capped port takes: 8080, 15014, 15017 and 15010 one each, 15012 three
# (the client's, the TLS front's to the inner gRPC server, and that server's side of it).
FDS_PER_CONNECTION = 7


class Discovery:
    """`istiod discovery`: source (config dir or Kubernetes) -> store -> pusher -> ADS, plus debug HTTP."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings.domain)
        self.store.subscribe(record_change)
        self._flag_selectors = tuple(parse_selector(s) for s in settings.discovery_selectors)
        self.namespaces = NamespaceFilter(settings.mesh.discovery_selectors or self._flag_selectors)
        self.source: ConfigDirSource | KubeSource | None = None
        self.publisher: RootCertPublisher | None = None
        self.election: LeaderElection | None = None
        self.analysis: tuple[LeaderElection, AnalysisController] | None = None
        self.pusher = Pusher(self.store, settings.debounce_after, settings.debounce_max, settings.mesh,
                             settings.eds_debounce)
        self.ads = DiscoveryServer(lambda: self.pusher.snapshot, settings.push_concurrency, settings.xds_send_timeout,
                                   settings.max_requests_per_second)
        self.pusher.subscribe(self.ads.on_push)
        self.jwks = JwksResolver(self.apply_jwks, settings.jwks_refresh_interval)
        self.pusher.subscribe(lambda event: self.jwks.want(event.snapshot))
        self.gateway_names = GatewayNameResolver(self.apply_gateway_addresses)
        self.pusher.subscribe(lambda event: self.gateway_names.want(event.snapshot))
        self.workers = WorkerPool(settings, self.store, self.pusher) if settings.xds_workers > 1 else None
        self.supervisor = Supervisor()
        self.secure = SecurePort(settings, self.ads, lambda: self.pusher.snapshot, self.supervisor, self.workers)
        self.health = health.aio.HealthServicer()
        self.ports: dict[str, int] = {}
        self._grpc: grpc.aio.Server | None = None
        self._http: list[uvicorn.Server] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._injector_view: Callable[[], Injector | None] | None = None
        self._api: client.ApiClient | None = None
        self._mesh_synced = asyncio.Event()  # set now unless the mesh config comes from the cluster
        self._mesh_synced.set()

    async def _make_source(self) -> ConfigDirSource | KubeSource:
        settings = self.settings
        if settings.config_dir is not None:
            return ConfigDirSource(settings.config_dir, self.store, settings.poll_interval)
        if not settings.in_cluster and settings.kubeconfig is None:
            raise ValueError("no config dir, no kubeconfig and not in a pod: nothing to read the mesh from")
        try:
            self._api = await api_client(None if settings.in_cluster else settings.kubeconfig)
        except (ConfigException, OSError, yaml.YAMLError) as error:
            where = "the in-cluster config" if settings.in_cluster else f"kubeconfig {settings.kubeconfig}"
            raise SystemExit(f"istiod: cannot use {where}: {logs.one_line(error)}") from None
        return KubeSource(self._api, self.store, self.namespaces, settings.watch_timeout, settings.revision)

    def apply_mesh(self, mesh: MeshConfig) -> None:
        """A changed mesh config, applied without a restart: namespaces are filtered again and every
        proxy gets a full push. (The CA keeps the trust domain it started with.)"""
        if self.settings.networks_config is not None:  # as istiod, the networks file wins over the ConfigMap's key
            mesh = MeshNetworks.of(self.pusher.mesh).apply(mesh)
        mesh = dataclasses.replace(mesh, gateway_addresses=self.pusher.mesh.gateway_addresses)  # not config
        self.pusher.mesh = mesh
        if isinstance(self.source, KubeSource):
            self.source.writer.reselect(mesh.discovery_selectors or self._flag_selectors)
        log.info(logs.event("mesh config applied", trust_domain=mesh.trust_domain, root_namespace=mesh.root_namespace,
                            outbound_traffic_policy=mesh.outbound_traffic_policy.value,
                            discovery_selectors=len(mesh.discovery_selectors)))
        if self.ads.ready:
            self.pusher.publish(full=True)

    def apply_networks(self, networks: MeshNetworks) -> None:
        """The --networksConfig file changed: every proxy gets a full push (EDS differs per network)."""
        self.pusher.mesh = networks.apply(self.pusher.mesh)
        log.info(logs.event("mesh networks applied", gateways=len(networks.network_gateways)))
        if self.ads.ready:
            self.pusher.publish(full=True)

    def apply_gateway_addresses(self, addresses: Mapping[str, tuple[str, ...]]) -> None:
        """Network gateways' hostnames resolved to other addresses: every proxy gets a full push (EDS)."""
        self.pusher.mesh = dataclasses.replace(self.pusher.mesh, gateway_addresses=tuple(sorted(addresses.items())))
        if self.ads.ready:
            self.pusher.publish(full=True)

    def apply_jwks(self, keys: Mapping[str, str]) -> None:
        """Keys fetched from a jwksUri changed: every proxy gets a full push (as istiod); before
        the sources synced, the first push takes them."""
        self.pusher.jwks = keys
        if self.ads.ready:
            self.pusher.publish(full=True)

    def _register_workload_entries(self) -> None:
        settings = self.settings
        controller = WorkloadEntryController(
            KubeEntryStore(self._api) if self._api is not None else None, lambda: self.pusher.snapshot.config,
            settings.pod_name, settings.workload_entry_grace, settings.workload_entry_validate_identity,
            auto_register=settings.workload_entry_autoregistration, health_checks=settings.workload_entry_health_checks)
        self.ads.registrar = controller
        if self.workers is not None:
            self.workers.registrar = controller
        if self._api is not None:
            self._tasks.append(self.supervisor.start("workload-entry-cleanup", controller.run, restart=True))

    async def start(self) -> None:
        """The CA first (a CA that cannot start stops istiod before any port opens), then the mesh
        config, the xDS, HTTP and webhook ports, and the tasks that feed and publish."""
        self.source = await self._make_source()
        self._register_workload_entries()
        await self._start_ca()
        self._watch_mesh_config()
        self.jwks.want(self.pusher.snapshot)
        self._tasks.append(self.supervisor.start("jwks-resolver", self.jwks.run, restart=True))
        self._tasks.append(self.supervisor.start("gateway-names", self.gateway_names.run, restart=True))
        await self._serve_xds()
        self._serve_http()
        self._serve_webhooks()
        self._run_background()
        log.info(logs.event("serving", **self.ports))
        log.info(logs.event("listening", **_urls(self.settings, self.ports)))
        if self.settings.ports_file:
            self.settings.ports_file.write_text(json.dumps(self.ports))

    async def _start_ca(self) -> None:
        settings = self.settings
        if isinstance(self.source, KubeSource):  # the CA's leader-elected writer
            api = self.source.api
            self.publisher = RootCertPublisher(api, self.store, self.namespaces, self.source.informers["Namespace"].synced,
                                               settings.watch_timeout)
            self.election = LeaderElection(api, settings.namespace, ELECTION, settings.pod_name, settings.leader,
                                           settings.revision)
            if settings.analysis:  # the analysis controller's writer, elected on its own lock as istiod's
                self.analysis = (LeaderElection(api, settings.namespace, ANALYSIS_ELECTION, settings.pod_name,
                                                settings.leader, settings.revision),
                                 AnalysisController(api, self.store, self.source.synced, settings.analysis_interval))
        # Before any port opens: a CA that cannot start stops istiod here.
        with _listening("--secure-grpc-addr", settings.secure_grpc_addr):
            self.ports["secure-grpc"] = await self.secure.start(self._api,
                                                                self.publisher.publish if self.publisher else None)

    def _watch_mesh_config(self) -> None:
        """The mesh config after the CA, which must hold its root before anything else starts."""
        settings = self.settings
        if settings.networks_config is not None:
            networks = MeshFileWatcher(settings.networks_config, read_mesh_networks_file, self.apply_networks,
                                       settings.poll_interval)
            self._tasks.append(self.supervisor.start("mesh-networks", networks.run, restart=True))
        if settings.mesh_config is not None:
            watcher = MeshFileWatcher(settings.mesh_config, functools.partial(read_mesh_file, base=settings.mesh_defaults),
                                      self.apply_mesh, settings.poll_interval)
            self._tasks.append(self.supervisor.start("mesh-config", watcher.run, restart=True))
        elif isinstance(self.source, KubeSource):
            configmap = MeshConfigMapWatcher(self.source.api, settings.namespace, settings.mesh_defaults,
                                             self.apply_mesh, settings.watch_timeout, mesh_configmap(settings.revision))
            self._mesh_synced = configmap.informer.synced
            self._tasks.append(self.supervisor.start("mesh-config", configmap.informer.run, restart=True))

    async def _serve_xds(self) -> None:
        """The plaintext xDS port: served by the xDS workers, or by this process."""
        settings = self.settings
        grpc_addr = self.settings.grpc_addr
        if self.workers is not None:  # they serve the port; a port in use stops istiod here all the same
            with _listening("--grpc-addr", grpc_addr):
                self.ports["grpc"] = self.workers.reserve()
            for index in range(settings.xds_workers):
                self._tasks.append(self.supervisor.start(f"xds-worker-{index}", functools.partial(self.workers.run, index),
                                                         restart=True))
        else:
            # so_reuseport off: a second istiod on the same port must fail, not silently share it.
            self._grpc = ads_server(self.ads, self.health, settings.keepalive, reuse_port=False,
                                    max_connections=settings.max_connections)
            reflection.enable_server_reflection((ADS_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
            await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            with _listening("--grpc-addr", grpc_addr):
                self.ports["grpc"] = self._grpc.add_insecure_port(join_host_port(grpc_addr.bind_host, grpc_addr.port))
            await self._grpc.start()

    def _serve_http(self) -> None:
        """The debug (8080) and monitoring (15014) ports."""
        settings = self.settings
        view = DebugView(lambda: self.pusher.snapshot, self._answers, self.not_ready, self.store.objects)
        try:
            access = AccessPolicy.from_token_file(self.settings.debug_token_file, self.secure.authenticators,
                                                  self.settings.namespace)
        except (OSError, ValueError) as error:
            raise SystemExit(f"istiod: --debug-auth-token-file: {logs.one_line(error)}") from None
        # istioctl's xDS debug types; `istio.io/debug` runs the debug handlers in-process (istiod's internal mux).
        self.ads.debug_types = DebugTypes(
            view.ask, create_app(view), control_plane_identifier(settings.pod_name), settings.namespace,
            settings.debug_endpoint_auth, settings.debug_auth_allowed_namespaces)
        for name, address in (("http", self.settings.http_addr), ("monitoring", self.settings.monitoring_addr)):
            with _listening(f"--{name}-addr", address):
                sock = listen_tcp(address.bind_host, address.port)
            self.ports[name] = sock.getsockname()[1]
            app = create_app(view, access, monitoring=name == "monitoring")
            server = uvicorn.Server(guarded_config(app, settings.http_read_timeout, settings.max_connections))
            self._http.append(server)
            # A server that ends is not restarted: its socket is gone with it.
            self._tasks.append(self.supervisor.start(name, functools.partial(server.serve, sockets=[sock]), restart=False))

    def _serve_webhooks(self) -> None:
        """The webhooks' port (15017)."""
        settings = self.settings
        assert self.secure.ca is not None
        with _listening("--webhook-addr", settings.webhook_addr):
            sock = listen_tcp(settings.webhook_addr.bind_host, settings.webhook_addr.port)
        webhook = WebhookServer(settings, self.secure.ca, self._injector())
        self.ports["webhook"] = sock.getsockname()[1]
        self._http.append(webhook.server)
        self._tasks.append(self.supervisor.start("webhook", functools.partial(webhook.serve, sock), restart=False))

    def _run_background(self) -> None:
        """The tasks that read the source and push, and what istiod writes to the cluster: the
        webhooks' caBundles and (leader-elected) the root certificate."""
        settings = self.settings
        assert self.secure.ca is not None
        self._tasks += [
            self.supervisor.start("source", self._read_source, restart=True),
            self.supervisor.start("pusher", self._push, restart=True),
            self.supervisor.start("malloc-trim", trim_when_free, restart=True),
        ]
        if self._api is not None:
            for name, patcher in (
                ("webhook-ca-bundle", CaBundlePatcher(self._api, self.secure.ca, "validating", settings.revision)),
                ("injector-ca-bundle", CaBundlePatcher(self._api, self.secure.ca, "mutating", settings.revision)),
            ):
                self._tasks.append(self.supervisor.start(name, patcher.run, restart=True))
        if self.election is not None and self.publisher is not None:
            election, publisher = self.election, self.publisher
            assert self._api is not None
            status = GatewayStatusWriter(self._api, self.store, lambda: self.pusher.snapshot.config.gateway_api)
            injector = self._injector()
            # The Gateways' proxies as the injector's values name them (image, CA address, cluster),
            # as istiod renders its gateway template with them.
            deployer = GatewayDeployer(self._api, self.store, lambda: (injector() or Injector(False, {})).variables(),
                                       self.settings.namespace)

            async def lead() -> None:  # the leader's writers: the root certificate, the Gateway API's status and deployments
                await asyncio.gather(publisher.run(), status.run(), deployer.run())

            self._tasks.append(self.supervisor.start("root-cert-publisher", lambda: election.run(lead), restart=True))
        if self.analysis is not None:
            analysis_election, controller = self.analysis
            self._tasks.append(self.supervisor.start("analysis-controller",
                                                     lambda: analysis_election.run(controller.run), restart=True))

    async def _answers(self, question: Question) -> list[Any]:
        """The debug views' answers: this process's (15012's connections), then every xDS worker's."""
        own = answer(question, self.ads.connections, self.ads.monitor.last_push)
        return [own, *(await self.workers.ask(question) if self.workers is not None else [])]

    def _injector(self) -> Callable[[], Injector | None]:
        """What /inject and the Gateways' deployments use: one view, made once."""
        if self._injector_view is None:
            read = self._read_injector()

            def view() -> Injector | None:  # the mesh's defaultConfig and ProxyConfig objects, as of this pod's injection
                injector, mesh = read(), self.pusher.mesh
                return injector and dataclasses.replace(
                    injector, proxy_configs=tuple(self.store.values("ProxyConfig")), root_namespace=mesh.root_namespace,
                    mesh_default_config=json.loads(mesh.default_config.json or "{}"))

            self._injector_view = view
        return self._injector_view

    def _read_injector(self) -> Callable[[], Injector | None]:
        """The --injection-dir files, or the watched ConfigMap in a cluster."""
        if self.settings.injection_dir is not None:
            try:
                injector = read_injection_dir(self.settings.injection_dir)
            except InjectionError as error:
                raise SystemExit(f"istiod discovery: --injection-dir: {error}") from None
            return lambda: injector
        if isinstance(self.source, KubeSource):
            watcher = InjectorConfigMapWatcher(self.source.api, self.settings.namespace, self.settings.watch_timeout,
                                               injector_configmap(self.settings.revision))
            self._tasks.append(self.supervisor.start("injector-config", watcher.informer.run, restart=True))
            return lambda: watcher.current
        return lambda: None

    async def _read_source(self) -> None:
        # The mesh config's discoverySelectors apply before the informers list; until then /ready
        # says the sources have not synced (the ports are open: the API may be down for a while).
        await self._mesh_synced.wait()
        assert self.source is not None
        await self.source.run()

    async def _push(self) -> None:
        if self.ads.ready:  # a restart: what the crashed run had taken from the store is built again
            self.pusher.publish(full=True)
        await self.pusher.run()

    def not_ready(self) -> str | None:
        """Why /ready answers 503, or None."""
        if self.supervisor.failure is not None:
            return f"{self.supervisor.failure}; istiod is stopping"
        if self.supervisor.stopping:
            return "istiod is shutting down"
        if not self.ads.ready:
            return "sources have not synced"
        if self.workers is not None and (starting := self.workers.not_ready()):
            return starting
        serving = self.secure.serving
        return serving.expiring(datetime.now(timezone.utc)) if serving is not None else None

    async def wait_synced(self) -> None:
        """Ready once the source has synced and the first snapshot is built from it."""
        assert self.source is not None
        await self.source.synced.wait()
        self.pusher.publish(full=True)
        settle_heap()
        self.ads.ready = True
        if self.workers is not None:
            self.workers.set_ready(True)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("sources synced; ready with %d services", len(self.pusher.snapshot.services))
        source = self.settings.config_dir or self.settings.kubeconfig or "the in-cluster config"
        log.info(logs.event("loaded", source=source, **Counter(o.key.kind for o in self.store.objects())))

    async def stop(self) -> None:
        self.supervisor.stopping = True
        self.ads.ready = False
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        # Both xDS ports at once: GOAWAY to every connection and new streams refused now; open
        # streams closed after the grace.
        grace = self.settings.shutdown_duration
        await asyncio.gather(self.secure.stop(grace), *([self._grpc.stop(grace=grace)] if self._grpc else []),
                             *([self.workers.stop(grace)] if self.workers else []))
        for server in self._http:
            server.should_exit = True
        for task in self._tasks:
            if task.get_name() not in ("http", "monitoring", "webhook"):
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
    raise_open_file_limit()
    flag = "--max-connections" if settings.max_connections != MAX_CONNECTIONS else ""
    settings = dataclasses.replace(settings, max_connections=sized_cap(settings.max_connections, FDS_PER_CONNECTION, flag))
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


@contextlib.contextmanager
def _listening(flag: str, address: Address) -> Iterator[None]:
    """A port that cannot be opened stops istiod with one line naming the address and its flag."""
    try:
        yield
    except RuntimeError:  # grpcio says only that binding failed: a plain socket tells why
        try:
            listen_tcp(address.bind_host, address.port).close()
            reason = "grpcio could not bind it"
        except OSError as error:
            reason = _os_reason(error)
        raise SystemExit(f"istiod: cannot listen on {address} ({flag}): {reason}; choose another with {flag}") from None
    except OSError as error:
        if error.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        raise SystemExit(f"istiod: cannot listen on {address} ({flag}): {_os_reason(error)};"
                         f" choose another with {flag}") from None


def _os_reason(error: OSError) -> str:
    return "the port is in use" if error.errno == errno.EADDRINUSE else (error.strerror or str(error)).lower()


def _urls(settings: Settings, ports: dict[str, int]) -> dict[str, str]:
    """Where to point clients, browsers and Prometheus (loopback names for addresses bound to every interface)."""
    def at(address: Address, port: int) -> str:
        return join_host_port(address.host or "localhost", port)

    return {
        "xds": at(settings.grpc_addr, ports["grpc"]),
        "xds_tls_and_ca": at(settings.secure_grpc_addr, ports["secure-grpc"]),
        "debug": f"http://{at(settings.http_addr, ports['http'])}/debug",
        "metrics": f"http://{at(settings.monitoring_addr, ports['monitoring'])}/metrics",
    }

"""istiod's secure port (15012): xDS and the CA over TLS, with istiod's own certificate from its CA.

The CA is a plugged-in one (--plugged-ca-dir) or a self-signed root persisted: against a cluster in
the Secret istio-ca-secret, with callers' tokens checked by TokenReview and the root published by
the caller's `publish_root` (the istio-ca-root-cert ConfigMaps); in config-dir mode in the state
dir, with the static-token stand-in, and the root published as `<state dir>/root-cert.pem` so
agents on this machine can trust istiod.

The port is served here through a TLS front (tlsfront.py), or with --xds-workers by the workers, each
through its own (xds/secureworker.py), this process then answering their CSRs and token checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc
from kubernetes_asyncio import client

from istiod.atomicfile import write_atomic
from istiod.ca.authenticate import (
    TOKEN, Authenticator, ClientCertAuthenticator, StaticTokenAuthenticator, TokenReviewAuthenticator,
)
from istiod.ca.root import ROOT_CERT_FILE, CaBundle, CertificateAuthority
from istiod.ca.selfsigned import DirRootStore, RootRotator, RootStore, SecretRootStore, self_signed_bundle
from istiod.ca.serving import ServingCertificate, serving_names
from istiod.ca.nodeauth import NodeAuthorizer
from istiod.ca.service import CertificateService
from istiod.ca.service import add_to_server as add_ca_to_server
from istiod.model.snapshot import Snapshot
from istiod.settings import Settings
from istiod.supervisor import Supervisor
from istiod.tlsfront import TlsFront
from istiod.xds import admission
from istiod.xds.authz import XdsAuthorizer
from istiod.xds.secureworker import answer
from istiod.xds.server import DiscoveryServer, add_to_server
from istiod.xds.workers import WorkerPool

log = logging.getLogger(__name__)


class SecurePort:
    def __init__(self, settings: Settings, ads: DiscoveryServer, snapshot: Callable[[], Snapshot],
                 supervisor: Supervisor | None = None, workers: WorkerPool | None = None) -> None:
        """`snapshot`: the model in force, for the mesh's trust domain and the node authorizer's pods;
        `workers`: the xDS workers, which then serve the port (secureworker.py), this process signing."""
        self.settings = settings
        self.workers = workers
        self.ads = ads
        self.snapshot = snapshot
        self.supervisor = supervisor or Supervisor()
        self.ca: CertificateAuthority | None = None
        self.serving: ServingCertificate | None = None
        self._inner: grpc.aio.Server | None = None
        self._front: TlsFront | None = None
        self._watch: asyncio.Task[None] | None = None
        self._renewal: asyncio.Task[None] | None = None
        self._rotation: asyncio.Task[None] | None = None
        self._rotator: RootRotator | None = None
        self.authenticators: list[Authenticator] = []  # set by start(); the debug access check uses them too
        self._publish_root: Callable[[CaBundle], None] = self._write_root_file

    async def start(self, api: client.ApiClient | None = None,
                    publish_root: Callable[[CaBundle], None] | None = None) -> int:
        """`api` given: the cluster's mode (Secret, TokenReview, `publish_root`); else config-dir mode."""
        settings, ca_settings = self.settings, self.settings.ca
        trust_domain = settings.mesh.trust_domain
        authenticators = self.authenticators = [ClientCertAuthenticator(lambda: self.snapshot().mesh)]
        self._publish_root = publish_root or self._write_root_file
        try:
            if ca_settings.plugged_dir is not None:
                self.ca = CertificateAuthority.plugged(ca_settings.plugged_dir)
                where = str(ca_settings.plugged_dir)
            else:
                store: RootStore = (SecretRootStore(client.CoreV1Api(api), settings.namespace) if api is not None
                                    else DirRootStore(ca_settings.state_dir))
                self.ca = CertificateAuthority(await self_signed_bundle(store, trust_domain, ca_settings.root))
                self._rotator = RootRotator(store, self.ca, ca_settings.root, self._publish_root)
                where = store.where
            if api is not None:
                authenticators.append(TokenReviewAuthenticator(client.AuthenticationV1Api(api), trust_domain))
            elif ca_settings.static_tokens is not None:
                authenticators.append(StaticTokenAuthenticator.from_file(ca_settings.static_tokens, trust_domain))
        except (ValueError, OSError) as error:  # OSError: a state dir that cannot be created or written
            raise SystemExit(f"istiod: cannot start the CA: {error}") from None
        self._publish_root(self.ca.bundle)
        self.serving = serving = ServingCertificate(
            self.ca, serving_names(settings.namespace, settings.domain, ca_settings.extra_sans), ca_settings.ttl.default
        )
        serving.ssl_context()  # issue it now, so a CA that cannot sign fails at start

        nodes = NodeAuthorizer(ca_settings.trusted_node_accounts, self.snapshot)
        if self.workers is not None:
            service = CertificateService(self.ca, ca_settings.ttl, authenticators, nodes)
            tokens = [a for a in authenticators if a.credential == TOKEN]
            port = self.workers.serve_secure(lambda question: answer(question, service.sign_bytes, tokens),
                                             tokens[0].name if tokens else None, serving)
        else:
            port = await self._serve(authenticators, nodes)
        ca = self.ca
        if ca.plugged_dir is not None:
            self._watch = self.supervisor.start("ca-watch", lambda: ca.watch(ca_settings.reload_interval, self._publish_root),
                                                restart=True)
        self._renewal = self.supervisor.start("serving-cert", lambda: serving.keep_fresh(ca_settings.reload_interval),
                                              restart=True)
        if self._rotator is not None:
            self._rotation = self.supervisor.start("root-rotation", self._rotator.run, restart=True)
        log.info("CA root serial %x (%s)", self.ca.bundle.root.serial_number, where)
        return port

    async def _serve(self, authenticators: list[Authenticator], nodes: NodeAuthorizer) -> int:
        """The port served here: a TLS front relaying to a gRPC server on loopback."""
        settings, ca_settings, serving = self.settings, self.settings.ca, self.serving
        assert self.ca is not None and serving is not None
        # The same keepalive as 15010: its pings cross the TLS front, so a vanished peer is found as fast.
        self._inner = grpc.aio.server(options=[*admission.CORE_OPTIONS, *settings.keepalive.server_options()])
        backend_port = self._inner.add_insecure_port("127.0.0.1:0")
        self._front = front = TlsFront(settings.secure_grpc_addr.bind_host, settings.secure_grpc_addr.port,
                                       backend_port, serving.ssl_context, settings.keepalive.timeout,
                                       settings.max_connections)
        add_ca_to_server(CertificateService(self.ca, ca_settings.ttl, authenticators, nodes, front.credentials,
                                            front.client), self._inner)
        add_to_server(self.ads.authorized(XdsAuthorizer(authenticators, front.credentials), front.client), self._inner)
        await self._inner.start()
        return await front.start()

    def _write_root_file(self, bundle: CaBundle) -> None:
        write_atomic(self.settings.ca.state_dir / ROOT_CERT_FILE, bundle.roots_pem.encode())

    async def stop(self, grace: float = 1.0) -> None:
        """As 15010 drains: no new connections, a GOAWAY through the front to every open one, their
        streams closed after `grace`, then the front's connections."""
        for task in (self._watch, self._renewal, self._rotation):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._front is not None:
            self._front.stop_accepting()
        if self._inner is not None:
            await self._inner.stop(grace=grace)
        if self._front is not None:
            await self._front.stop()


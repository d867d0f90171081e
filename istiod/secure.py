"""istiod's secure port (15012): xDS and the CA over TLS, with istiod's own certificate from its CA.

The CA is a plugged-in one (--plugged-ca-dir) or a self-signed root persisted in the state dir. In
config-dir mode the root is also published as `<state dir>/root-cert.pem`, the stand-in for the
`istio-ca-root-cert` ConfigMap, so agents on this machine can trust istiod.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc

from istiod.atomicfile import write_atomic
from istiod.ca.authenticate import Authenticator, ClientCertAuthenticator, StaticTokenAuthenticator
from istiod.ca.root import ROOT_CERT_FILE, CaBundle, CertificateAuthority, DirRootStore, self_signed_bundle
from istiod.ca.serving import ServingCertificate, serving_names
from istiod.ca.service import CertificateService
from istiod.gen.istio.v1.auth import ca_pb2_grpc
from istiod.settings import Settings
from istiod.tlsfront import TlsFront
from istiod.xds.authz import XdsAuthorizer
from istiod.xds.server import DiscoveryServer

log = logging.getLogger(__name__)


class SecurePort:
    def __init__(self, settings: Settings, ads: DiscoveryServer) -> None:
        self.settings = settings
        self.ads = ads
        self.ca: CertificateAuthority | None = None
        self.serving: ServingCertificate | None = None
        self._inner: grpc.aio.Server | None = None
        self._front: TlsFront | None = None
        self._watch: asyncio.Task[None] | None = None
        self.authenticators: list[Authenticator] = []  # set by start(); the debug access check uses them too

    async def start(self) -> int:
        settings, ca_settings = self.settings, self.settings.ca
        authenticators = self.authenticators = [ClientCertAuthenticator()]
        try:
            if ca_settings.plugged_dir is not None:
                self.ca = CertificateAuthority.plugged(ca_settings.plugged_dir)
            else:
                store = DirRootStore(ca_settings.state_dir)
                self.ca = CertificateAuthority(await self_signed_bundle(store, settings.mesh.trust_domain))
            if ca_settings.static_tokens is not None:
                authenticators.append(StaticTokenAuthenticator.from_file(ca_settings.static_tokens, settings.mesh.trust_domain))
        except ValueError as error:
            raise SystemExit(f"istiod: cannot start the CA: {error}") from None
        self._publish_root(self.ca.bundle)
        self.serving = serving = ServingCertificate(
            self.ca, serving_names(ca_settings.namespace, settings.domain, ca_settings.extra_sans), ca_settings.ttl.default
        )
        serving.ssl_context()  # issue it now, so a CA that cannot sign fails at start

        self._inner = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1 << 20)])
        backend_port = self._inner.add_insecure_port("127.0.0.1:0")
        self._front = front = TlsFront(settings.secure_grpc_addr.bind_host, settings.secure_grpc_addr.port,
                                       backend_port, serving.ssl_context)
        ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(
            CertificateService(self.ca, ca_settings.ttl, authenticators, front.credentials), self._inner
        )
        ads = self.ads.authorized(XdsAuthorizer(authenticators, front.credentials))
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(ads, self._inner)
        await self._inner.start()
        port = await front.start()
        self._watch = asyncio.create_task(self.ca.watch(ca_settings.reload_interval, self._publish_root), name="ca-watch")
        log.info("CA root serial %x (%s)", self.ca.bundle.root.serial_number,
                 ca_settings.plugged_dir or ca_settings.state_dir)
        return port

    def _publish_root(self, bundle: CaBundle) -> None:
        write_atomic(self.settings.ca.state_dir / ROOT_CERT_FILE, bundle.roots_pem.encode())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._front is not None:
            await self._front.stop()
        if self._inner is not None:
            await self._inner.stop(grace=1.0)

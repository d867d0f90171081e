"""HTTPS for the webhooks: istiod's names, a certificate from istiod's CA renewed at half-life,
HTTP/1.1 only (the API server would pick h2 if it were offered, and uvicorn speaks HTTP/1.1)."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable

import uvicorn

from istiod.ca.root import CertificateAuthority
from istiod.ca.serving import ServingCertificate, serving_names
from istiod.debug.serving import guarded_config
from istiod.settings import Settings
from istiod.webhooks.injection import Injector, add_injection_route
from istiod.webhooks.validation import create_webhook_app


class WebhookServer:
    def __init__(self, settings: Settings, ca: CertificateAuthority, injector: Callable[[], Injector | None]) -> None:
        self.settings = settings
        self.cert = ServingCertificate(ca, serving_names(settings.namespace, settings.domain, settings.ca.extra_sans),
                                       settings.ca.ttl.default, alpn=("http/1.1",), server="webhook")
        app = create_webhook_app(settings.domain)
        add_injection_route(app, injector, settings.revision)
        # The same read timeout and connection cap as 8080 and 15014; asyncio bounds the TLS handshake (60s).
        config = guarded_config(app, settings.http_read_timeout, settings.max_connections)
        config.load()
        config.ssl = self._context()
        self.server = uvicorn.Server(config)

    def _context(self) -> ssl.SSLContext:
        """The first certificate's context; each handshake then switches to the current one (the
        callback runs with or without SNI), so a renewed certificate needs no restart."""
        context = self.cert.ssl_context()

        def current(connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
            connection.context = self.cert.ssl_context()

        context.sni_callback = current  # type: ignore[assignment]
        return context

    async def serve(self, sock: socket.socket) -> None:
        renewal = asyncio.create_task(self.cert.keep_fresh(self.settings.ca.reload_interval), name="webhook-cert")
        try:
            await self.server.serve(sockets=[sock])
        finally:
            renewal.cancel()

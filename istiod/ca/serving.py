"""istiod's own TLS certificate for its secure port, signed by its CA.

DNS names as istiod uses: istiod, istiod-remote and istio-pilot in istiod's namespace (`.svc` and
`.svc.<domain>`), plus extra names (ISTIOD_CUSTOM_HOST / --tls-extra-san; an IP becomes an IP SAN).
Re-issued at half its lifetime and whenever the CA's bundle changes (a plugged-in CA reloaded). A
failed renewal is logged, counted and retried with backoff; once less than a quarter of the
certificate's life is left, `expiring` says so, for /ready.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509

from istiod import logs, metrics
from istiod.backoff import Backoff
from istiod.ca.pki import cert_pem, key_pem, new_key
from istiod.ca.root import CaBundle, CertificateAuthority
from istiod.ca.signer import issue

log = logging.getLogger(__name__)
ISTIOD_SERVICES = ("istiod", "istiod-remote", "istio-pilot")
RENEWAL_RETRY = Backoff(initial=1.0, cap=30.0)


def serving_names(namespace: str, domain: str, extra: Sequence[str] = ()) -> list[x509.GeneralName]:
    hosts = [f"{name}.{namespace}.svc{suffix}" for name in ISTIOD_SERVICES for suffix in ("", f".{domain}")]
    names: list[x509.GeneralName] = [x509.DNSName(host) for host in hosts]
    for name in extra:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            names.append(x509.DNSName(name))
    return names


@dataclass(frozen=True, slots=True)
class ServingPem:
    """A serving certificate's chain and key, and the roots that client certificates must chain to."""

    chain: str
    key: bytes
    roots: str

    def __repr__(self) -> str:  # never print a key
        return f"ServingPem(chain={len(self.chain)} chars, key=<set>, roots={len(self.roots)} chars)"


def server_context(pem: ServingPem, alpn: Sequence[str]) -> ssl.SSLContext:
    """A server context for `pem`: client certificates optional but verified against its roots when
    given (as istiod), ALPN `alpn`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # ssl loads a key only from a file: a private directory that lives only for this call.
    with tempfile.TemporaryDirectory(prefix="istiod-tls-") as private:
        chain_file, key_file = Path(private) / "cert.pem", Path(private) / "key.pem"
        chain_file.write_text(pem.chain)
        key_file.touch(mode=0o600)
        key_file.write_bytes(pem.key)
        context.load_cert_chain(chain_file, key_file)
    context.load_verify_locations(cadata=pem.roots)
    context.verify_mode = ssl.CERT_OPTIONAL  # as istiod: verify a client certificate if given
    context.set_alpn_protocols(list(alpn))
    return context


class ServingCertificate:
    def __init__(self, ca: CertificateAuthority, names: list[x509.GeneralName], ttl: timedelta,
                 alpn: Sequence[str] = ("h2",), server: str = "xds") -> None:
        self.ca = ca
        self.server = server  # the metrics' label: "xds" (15012) or "webhook" (15017)
        self.alpn = list(alpn)  # h2 for gRPC; the webhooks' HTTP/1.1 server must not offer it
        self.names = names
        self.ttl = ttl
        self.cert: x509.Certificate | None = None
        self._bundle: CaBundle | None = None
        self._context: ssl.SSLContext | None = None
        self._renew_at = datetime.min.replace(tzinfo=timezone.utc)
        self._tried: CaBundle | None = None  # the last bundle the accept path tried to issue from
        self._failures = 0  # renewals failed in a row
        self.pem: ServingPem | None = None  # what the context is made of, for the processes that serve it too
        self._installed: list[Callable[[ServingPem], None]] = []

    def subscribe(self, callback: Callable[[ServingPem], None]) -> None:
        """`callback` is called with each certificate installed from now on."""
        self._installed.append(callback)

    def ssl_context(self) -> ssl.SSLContext:
        """The server context for new connections: our certificate, client certificates optional
        but verified against the CA's roots when given, ALPN h2 for gRPC. Issued here the first
        time (a failure then stops the start) and once when the CA itself changes (rare, and then
        no old certificate will do; a failure keeps the old one and `keep_fresh` retries);
        renewal at half-life happens in `keep_fresh`, off the accept path."""
        bundle, now = self.ca.bundle, datetime.now(timezone.utc)
        if self._context is None:
            self._install(*self._issue(bundle, now))
        elif bundle is not self._bundle and bundle is not self._tried:
            self._tried = bundle
            try:
                self._install(*self._issue(bundle, now))
            except Exception as error:
                self._failed(error)
        assert self._context is not None
        return self._context

    async def keep_fresh(self, interval: float) -> None:
        """Re-issue at half-life, or for a new CA, in a thread: key generation and file writes must
        not stall the event loop that serves every stream."""
        while True:
            await asyncio.sleep(RENEWAL_RETRY.delay(self._failures - 1) if self._failures else interval)
            now, bundle = datetime.now(timezone.utc), self.ca.bundle
            if now < self._renew_at and bundle is self._bundle:
                continue
            try:
                issued = await asyncio.to_thread(self._issue, bundle, now)
            except Exception as error:
                self._failed(error)
            else:
                self._install(*issued)

    def _failed(self, error: Exception) -> None:
        """Whatever failed (a full disk, a CA that cannot sign) is logged, counted and retried with
        backoff while the current certificate lasts; `expiring` tells /ready when that runs short."""
        self._failures += 1
        metrics.SERVING_CERT_RENEWAL_FAILURES.labels(server=self.server).inc()
        log.error(logs.event("serving certificate renewal failed", failures=self._failures,
                             expires=self.cert.not_valid_after_utc.isoformat() if self.cert else "",
                             error=f"{type(error).__name__}: {error}"))

    def expiring(self, now: datetime) -> str | None:
        """Why the certificate is a problem (less than a quarter of its life left), or None."""
        cert = self.cert
        if cert is None:
            return None
        left = cert.not_valid_after_utc - now
        if left * 4 > cert.not_valid_after_utc - cert.not_valid_before_utc:
            return None
        state = "expired" if left.total_seconds() <= 0 else "expires"
        return f"istiod's serving certificate {state} at {cert.not_valid_after_utc.isoformat()} and was not renewed"

    def _install(self, context: ssl.SSLContext, cert: x509.Certificate, bundle: CaBundle, now: datetime,
                 pem: ServingPem) -> None:
        self.cert, self._bundle, self.pem = cert, bundle, pem
        self._renew_at = now + (cert.not_valid_after_utc - now) / 2
        self._context = context
        for callback in self._installed:
            callback(pem)
        metrics.SERVING_CERT_EXPIRY_TIMESTAMP.labels(server=self.server).set(cert.not_valid_after_utc.timestamp())
        if self._failures:
            log.info(logs.event("serving certificate renewed", failed_attempts=self._failures))
        self._failures = 0

    def _issue(self, bundle: CaBundle, now: datetime
               ) -> tuple[ssl.SSLContext, x509.Certificate, CaBundle, datetime, ServingPem]:
        key = new_key()
        cert = issue(bundle, key.public_key(), self.names, now, self.ttl)
        chain = cert_pem(cert) + "".join(cert_pem(c) for c in bundle.issuers[:-1])
        pem = ServingPem(chain, key_pem(key), bundle.roots_pem)
        return server_context(pem, self.alpn), cert, bundle, now, pem

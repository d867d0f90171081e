"""`istiod agent`: the node-side helper of Istio's proxyless gRPC.

Reads the service-account token, makes a key and a CSR, has istiod's CA sign it over TLS, writes
cert-chain.pem, key.pem and root-cert.pem atomically, writes the gRPC bootstrap once the first
certificate is there, and renews at half the certificate's lifetime. A refused first request ends
the agent (exit 1) with the CA's reason; an unreachable CA, or any failed renewal, is retried with
backoff while the current certificate lasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from istiod.agent.bootstrap import bootstrap_json
from istiod.agent.metrics import OUTGOING_REQUESTS
from istiod.agent.settings import AgentSettings
from istiod.atomicfile import write_atomic
from istiod.ca.pki import PrivateKey, key_pem, load_certs, new_key, same_public_key, uri_sans
from istiod.certfiles import CERT_CHAIN_FILE, KEY_FILE, ROOT_CERT_FILE
from istiod.connlimit import raise_open_file_limit
from istiod.gen.istio.v1.auth import ca_pb2, ca_pb2_grpc
from istiod.model.names import spiffe_identity
from istiod.backoff import Backoff

log = logging.getLogger(__name__)
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
RETRY_BACKOFF = Backoff(initial=1.0, cap=30.0)


class AgentError(Exception):
    """A failure reported in one line; never contains the token or the key."""


class CaUnreachable(AgentError):
    pass


@dataclass(frozen=True, slots=True, eq=False)
class Issued:
    chain: tuple[str, ...]  # leaf first, root last, as the CA answered
    key: PrivateKey
    leaf: x509.Certificate

    @property
    def renew_at(self) -> datetime:
        """Half way through the certificate's life, as Istio's agent renews."""
        return self.leaf.not_valid_before_utc + (self.leaf.not_valid_after_utc - self.leaf.not_valid_before_utc) / 2

    def valid(self, now: datetime) -> bool:
        return now < self.leaf.not_valid_after_utc


def make_csr(key: PrivateKey, identity: str, trust_domain: str) -> str:
    """A CSR like Istio's agent sends; the CA takes only its key and puts in the caller's identity."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, trust_domain)]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]), critical=True)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


async def request_certificate(settings: AgentSettings, previous: Issued | None) -> Issued:
    """One CSR round trip. Authenticates with the token, or, if it cannot be read, the current certificate."""
    root = _read(settings.ca_root_cert, "the CA root certificate")
    now = datetime.now(timezone.utc)
    try:
        token: str | None = settings.token_file.read_text().strip()
    except OSError as error:
        if previous is None or not previous.valid(now):
            raise AgentError(f"cannot read the service account token {settings.token_file}: {error.strerror}") from None
        token = None  # renew with the certificate we hold
    key = new_key()
    identity = spiffe_identity(settings.trust_domain, settings.node.namespace, settings.node.service_account)
    request = ca_pb2.IstioCertificateRequest(
        csr=make_csr(key, identity, settings.trust_domain), validity_duration=int(settings.cert_ttl)
    )
    if token is None:
        assert previous is not None
        channel_creds = _client_tls(root, previous)
    else:
        channel_creds = grpc.composite_channel_credentials(
            grpc.ssl_channel_credentials(root), grpc.access_token_call_credentials(token)
        )
    metadata = (("clusterid", settings.node.cluster_id),)
    OUTGOING_REQUESTS.labels(request_type="csr").inc()
    async with grpc.aio.secure_channel(settings.ca_address, channel_creds) as channel:
        stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
        try:
            response = await stub.CreateCertificate(request, timeout=settings.ca_timeout, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            reason = f"{error.code().name}: {error.details()}"
            if error.code() in _UNREACHABLE:
                raise CaUnreachable(f"CA at {settings.ca_address} is unreachable: {reason}"
                                    f"{_name_hint(settings.ca_address, error.details() or '')}") from None
            raise AgentError(f"CA at {settings.ca_address} refused the certificate request: {reason}") from None
    chain = tuple(response.cert_chain)
    try:
        leaf = load_certs(chain[0].encode(), "the CA's answer")[0] if chain else None
    except ValueError as error:
        raise AgentError(str(error)) from None
    if leaf is None or len(chain) < 2 or not same_public_key(key, leaf):
        raise AgentError(f"CA at {settings.ca_address} answered with no usable certificate chain for our key")
    return Issued(chain, key, leaf)


def _name_hint(address: str, details: str) -> str:
    """What to change when istiod's certificate does not carry the name or IP the agent dials."""
    if "Hostname Verification Check failed" not in details:
        return ""
    host = address.rsplit(":", 1)[0].strip("[]")
    return (f"; istiod's certificate does not name {host}: start istiod with --tls-extra-san {host}"
            f" (ISTIOD_CUSTOM_HOST), or give --ca-addr a name it carries (istiod.istio-system.svc)")


def istiod_credentials(settings: AgentSettings, issued: Issued) -> grpc.ChannelCredentials:
    """TLS to istiod as pilot-agent's xDS proxy dials it: the workload certificate as the client
    certificate, and the service-account token too when it can be read."""
    creds = _client_tls(_read(settings.ca_root_cert, "the CA root certificate"), issued)
    try:
        token = settings.token_file.read_text().strip()
    except OSError:
        return creds
    return grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))


def _client_tls(root: bytes, issued: Issued) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root, key_pem(issued.key), "".join(issued.chain[:-1]).encode())


def write_certs(settings: AgentSettings, issued: Issued) -> None:
    """Root first, key, then the chain: gRPC's file watcher re-reads if files change while it reads."""
    directory = settings.certs.directory
    write_atomic(directory / ROOT_CERT_FILE, issued.chain[-1].encode())
    write_atomic(directory / KEY_FILE, key_pem(issued.key), mode=0o600)
    write_atomic(directory / CERT_CHAIN_FILE, "".join(issued.chain[:-1]).encode())


def write_bootstrap(settings: AgentSettings) -> None:
    write_atomic(settings.bootstrap_file, bootstrap_json(settings.xds_address, settings.node, settings.certs).encode())


async def keep_certificate(settings: AgentSettings, stop: asyncio.Event,
                           on_issued: Callable[[Issued, bool], None]) -> int:
    """Gets the certificate, writes its files, hands it to `on_issued` (with True the first time) and
    renews it at half-life until `stop`; 1 if the first request is refused, else 0."""
    issued: Issued | None = None
    attempt = 0  # failed requests since the last success
    while not stop.is_set():
        try:
            renewed = await request_certificate(settings, issued)
        except AgentError as error:
            if issued is None and not isinstance(error, CaUnreachable):
                log.error("%s", error)
                return 1
            delay = RETRY_BACKOFF.delay(attempt)
            attempt += 1
            log.error("%s; retrying in %.1fs", error, delay)
        else:
            write_certs(settings, renewed)
            on_issued(renewed, issued is None)
            issued = renewed
            log.info("wrote certificate for %s serial=%x expires=%s renew_at=%s into %s",
                     ",".join(uri_sans(issued.leaf)), issued.leaf.serial_number,
                     issued.leaf.not_valid_after_utc.isoformat(), issued.renew_at.isoformat(), settings.certs.directory)
            delay = (issued.renew_at - datetime.now(timezone.utc)).total_seconds()
            attempt = 0
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), max(delay, 0.0))
    return 0


async def run(settings: AgentSettings, stop: asyncio.Event) -> int:
    def issued(_: Issued, first: bool) -> None:
        if first:  # the workload may start once its certificates are in place
            write_bootstrap(settings)
            log.info("wrote the gRPC bootstrap %s", settings.bootstrap_file)

    return await keep_certificate(settings, stop, issued)


async def run_until_signalled(run: Callable[[asyncio.Event], Awaitable[int]]) -> int:
    """`run` with an event that SIGINT and SIGTERM set."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return await run(stop)


async def run_agent(settings: AgentSettings) -> int:
    raise_open_file_limit()  # as pilot-agent (a Go program) does at start
    return await run_until_signalled(lambda stop: run(settings, stop))


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise AgentError(f"cannot read {what} {path}: {error.strerror}") from None


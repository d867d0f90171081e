"""The CA's root of trust: a self-signed root created once and persisted, or a plugged-in CA.

Like istiod: the self-signed root lives in the Secret `istio-ca-secret` (or, in config-dir mode, a
directory of the same name under the state dir), created only if absent so two replicas agree on
one root. A plugged-in CA is read from `ca-cert.pem`, `ca-key.pem`, `cert-chain.pem` and
`root-cert.pem` and reloaded when those files change.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Protocol

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod import metrics
from istiod.ca.pki import PrivateKey, cert_pem, key_pem, key_usage, load_certs, load_key, new_key, same_public_key
from istiod.certfiles import CERT_CHAIN_FILE, ROOT_CERT_FILE
from istiod.backoff import Backoff
from istiod.sources.kube import API_ERRORS, describe_error

log = logging.getLogger(__name__)

CA_SECRET = "istio-ca-secret"
CA_CERT_FILE = "ca-cert.pem"
CA_KEY_FILE = "ca-key.pem"
ROOT_TTL = timedelta(days=3650)  # istiod's self-signed root lives 10 years
REQUEST_TIMEOUT = 10.0
SECRET_PATIENCE = 1200.0  # istiod gives up on its CA Secret after 20 minutes
SECRET_BACKOFF = Backoff(initial=0.5, cap=10.0)

RootPair = tuple[bytes, bytes]  # (certificate PEM, private key PEM)


@dataclass(frozen=True, slots=True, eq=False)
class CaBundle:
    """What the CA signs with, and what it tells workloads to trust."""

    cert: x509.Certificate  # signs workload certificates
    key: PrivateKey
    issuers: tuple[x509.Certificate, ...]  # cert, its intermediates and the root it chains to
    roots: tuple[x509.Certificate, ...]  # every trusted root (root-cert.pem)

    @property
    def roots_pem(self) -> str:
        return "".join(cert_pem(root) for root in self.roots)

    @property
    def root(self) -> x509.Certificate:
        """The root this CA's chain ends in."""
        return self.issuers[-1]


def self_signed_root(trust_domain: str, now: datetime, ttl: timedelta = ROOT_TTL) -> RootPair:
    """A new root as istiod makes it: RSA 2048, subject O=<trust domain>, 10 years."""
    key = new_key()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, trust_domain)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + ttl)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert_pem(cert).encode(), key_pem(key)


def bundle_from_pem(ca_cert: bytes, ca_key: bytes, cert_chain: bytes, root_cert: bytes) -> CaBundle:
    """Check and assemble CA material; ValueError says which file is wrong and how."""
    cert = load_certs(ca_cert, CA_CERT_FILE)[0]
    key = load_key(ca_key, CA_KEY_FILE)
    if not same_public_key(key, cert):
        raise ValueError(f"{CA_KEY_FILE} is not the key of {CA_CERT_FILE}")
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise ValueError(f"{CA_CERT_FILE} is not a CA certificate (basicConstraints CA:TRUE missing)")
    if cert.not_valid_after_utc <= datetime.now(timezone.utc):
        raise ValueError(f"{CA_CERT_FILE} expired at {cert.not_valid_after_utc.isoformat()}")
    roots = tuple(load_certs(root_cert, ROOT_CERT_FILE))
    chain = load_certs(cert_chain, CERT_CHAIN_FILE) if cert_chain.strip() else []
    path = [cert] + [c for c in chain if c != cert and c not in roots]
    for child, parent in zip(path, path[1:]):
        if not _issued_by(child, parent):
            raise ValueError(f"{CERT_CHAIN_FILE}: {child.subject.rfc4514_string()!r} is not issued by the next certificate")
    if path[-1] in roots:
        return CaBundle(cert, key, tuple(path), roots)
    root = next((r for r in roots if _issued_by(path[-1], r)), None)
    if root is None:
        raise ValueError(f"{CA_CERT_FILE} does not chain to any certificate in {ROOT_CERT_FILE}")
    return CaBundle(cert, key, (*path, root), roots)


def _issued_by(child: x509.Certificate, parent: x509.Certificate) -> bool:
    try:
        child.verify_directly_issued_by(parent)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


class RootStore(Protocol):
    """Where the self-signed root persists; `create` runs only if there is none yet."""

    where: str

    async def load_or_create(self, create: Callable[[], RootPair]) -> RootPair: ...


class DirRootStore:
    """Config-dir mode: `<state dir>/istio-ca-secret/{ca-cert.pem,ca-key.pem}`."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / CA_SECRET
        self.where = str(self.path)

    async def load_or_create(self, create: Callable[[], RootPair]) -> RootPair:
        return await asyncio.to_thread(self._load_or_create, create)

    def _load_or_create(self, create: Callable[[], RootPair]) -> RootPair:
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".ca-", dir=self.path.parent))
            cert, key = create()
            (staging / CA_CERT_FILE).write_bytes(cert)
            key_file = staging / CA_KEY_FILE
            key_file.touch(mode=0o600)
            key_file.write_bytes(key)
            try:
                # Renaming a directory onto a non-empty one fails: the first istiod to get here wins.
                os.rename(staging, self.path)
                log.info("created a self-signed root CA in %s", self.path)
            except OSError:
                shutil.rmtree(staging)
        return (self.path / CA_CERT_FILE).read_bytes(), (self.path / CA_KEY_FILE).read_bytes()


class SecretRootStore:
    """Kubernetes: Secret `istio-ca-secret` in istiod's namespace, created only if absent.

    Needs no leader: a create that finds the Secret already there (409) reads the winner's. API
    errors are retried with backoff for up to 20 minutes, as istiod does, so a replica that starts
    before the API server answers, or before its RBAC is in place, still starts.
    """

    def __init__(self, core: client.CoreV1Api, namespace: str) -> None:
        self.core = core
        self.namespace = namespace
        self.where = f"Secret {namespace}/{CA_SECRET}"

    async def load_or_create(self, create: Callable[[], RootPair]) -> RootPair:
        deadline = time.monotonic() + SECRET_PATIENCE
        attempt = 0
        while True:
            try:
                return await self._load_or_create(create)
            except API_ERRORS as error:
                reason = describe_error(error)
                if time.monotonic() >= deadline:
                    raise ValueError(f"cannot read or create {self.where} for {SECRET_PATIENCE:g}s: {reason}") from None
                delay = SECRET_BACKOFF.delay(attempt)
                attempt += 1
                log.warning("CA root: cannot read or create %s: %s; retrying in %.1fs", self.where, reason, delay)
                await asyncio.sleep(delay)

    async def _load_or_create(self, create: Callable[[], RootPair]) -> RootPair:
        try:
            return _secret_pair(await self._read())
        except ApiException as error:
            if error.status != 404:
                raise
        cert, key = create()
        data = {CA_CERT_FILE: cert, CA_KEY_FILE: key, CERT_CHAIN_FILE: b"", ROOT_CERT_FILE: b""}
        secret = client.V1Secret(
            metadata=client.V1ObjectMeta(name=CA_SECRET, namespace=self.namespace),
            type="istio.io/ca-root",
            data={k: base64.b64encode(v).decode() for k, v in data.items()},
        )
        try:
            await self.core.create_namespaced_secret(self.namespace, secret, _request_timeout=REQUEST_TIMEOUT)
            log.info("created a self-signed root CA in %s", self.where)
            return cert, key
        except ApiException as error:
            if error.status != 409:
                raise
        # Another replica created it between our read and create: use theirs.
        return _secret_pair(await self._read())

    async def _read(self) -> client.V1Secret:
        return await self.core.read_namespaced_secret(CA_SECRET, self.namespace, _request_timeout=REQUEST_TIMEOUT)


def _secret_pair(secret: object) -> RootPair:
    data = getattr(secret, "data", None) or {}
    if CA_CERT_FILE not in data or CA_KEY_FILE not in data:
        raise ValueError(f"Secret {CA_SECRET} has no {CA_CERT_FILE} or {CA_KEY_FILE}")
    return base64.b64decode(data[CA_CERT_FILE]), base64.b64decode(data[CA_KEY_FILE])


async def self_signed_bundle(store: RootStore, trust_domain: str) -> CaBundle:
    cert, key = await store.load_or_create(lambda: self_signed_root(trust_domain, datetime.now(timezone.utc)))
    try:
        return bundle_from_pem(cert, key, b"", cert)
    except ValueError as error:
        raise ValueError(f"the root CA in {store.where} is unusable: {error}") from None


def read_plugged(directory: Path) -> tuple[bytes, bytes, bytes, bytes]:
    """The four files of a plugged-in CA (cert-chain.pem may be absent when ca-cert is the root)."""
    chain = directory / CERT_CHAIN_FILE
    return (
        (directory / CA_CERT_FILE).read_bytes(),
        (directory / CA_KEY_FILE).read_bytes(),
        chain.read_bytes() if chain.exists() else b"",
        (directory / ROOT_CERT_FILE).read_bytes(),
    )


class CertificateAuthority:
    """The bundle in force. A plugged-in one is re-read when its files change; bad files keep the old one."""

    def __init__(
        self,
        bundle: CaBundle,
        plugged_dir: Path | None = None,
        files: tuple[bytes, bytes, bytes, bytes] | None = None,
    ) -> None:
        """`files` are the plugged-in files `bundle` was built from, so a change after that read is seen."""
        self.bundle = bundle
        self.plugged_dir = plugged_dir
        self._files = files

    @property
    def bundle(self) -> CaBundle:
        return self._bundle

    @bundle.setter
    def bundle(self, bundle: CaBundle) -> None:
        """Every bundle put in force sets the expiry gauges, from the start, not from the first CSR."""
        self._bundle = bundle
        _record_expiry(bundle.root.not_valid_after_utc.timestamp(),
                       min(c.not_valid_after_utc for c in bundle.issuers).timestamp())

    @classmethod
    def plugged(cls, directory: Path) -> CertificateAuthority:
        try:
            files = read_plugged(directory)
            bundle = bundle_from_pem(*files)
        except (OSError, ValueError) as error:
            raise ValueError(f"plugged-in CA in {directory}: {error}") from None
        return cls(bundle, directory, files)

    async def watch(self, interval: float, on_change: Callable[[CaBundle], None]) -> None:
        """A plugged-in CA's files, checked every `interval`."""
        assert self.plugged_dir is not None
        while True:
            await asyncio.sleep(interval)
            try:
                files = await asyncio.to_thread(read_plugged, self.plugged_dir)
            except OSError as error:
                log.warning("plugged-in CA in %s unreadable, keeping the current one: %s", self.plugged_dir, error)
                continue
            if files == self._files:
                continue
            self._files = files
            try:
                bundle = bundle_from_pem(*files)
            except ValueError as error:
                log.error("plugged-in CA in %s not reloaded, keeping the current one: %s", self.plugged_dir, error)
                continue
            self.bundle = bundle
            log.info("reloaded the plugged-in CA from %s (signing cert serial %x)", self.plugged_dir, bundle.cert.serial_number)
            on_change(bundle)


def _record_expiry(root_expiry: float, chain_expiry: float) -> None:
    """The timestamps as Istio sets them; the seconds-left gauges count down at scrape time."""
    metrics.ROOT_CERT_EXPIRY_TIMESTAMP.set(root_expiry)
    metrics.CERT_CHAIN_EXPIRY_TIMESTAMP.set(chain_expiry)
    metrics.ROOT_CERT_EXPIRY_SECONDS.set_function(lambda: root_expiry - time.time())
    metrics.CERT_CHAIN_EXPIRY_SECONDS.set_function(lambda: chain_expiry - time.time())

"""istiod's self-signed root: created once, persisted, and rotated before it expires.

Like istiod: the root lives in the Secret `istio-ca-secret` (or, in config-dir mode, a directory of
the same name under the state dir), created only if absent so two replicas agree on one root.

Rotation as istiod's self-signed root rotator does it: every check interval (1h, the first check at
a random point within it) the stored root is read; once less than the grace period (20% of its
lifetime) is left, or it has expired, a new root is made from the SAME key and subject, so every
certificate the old root signed still verifies against the new one. Unlike istiod, the old root
also stays in the trust bundle (`root-cert.pem`) until it expires, so peers that check the exact
anchor trust both during the overlap. A replica that finds another's rotation in the store adopts
it; writes carry the version they read, so of two replicas rotating at once one wins.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Protocol, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod import logs
from istiod.atomicfile import write_atomic
from istiod.backoff import Backoff
from istiod.ca.pki import (
    PrivateKey, cert_pem, key_pem, key_usage, load_certs, load_key, new_key, subject_key_identifier,
)
from istiod.ca.settings import RootPolicy
from istiod.ca.root import CA_CERT_FILE, CA_KEY_FILE, CaBundle, CertificateAuthority, bundle_from_pem
from istiod.certfiles import CERT_CHAIN_FILE, ROOT_CERT_FILE
from istiod.sources.kube import API_ERRORS, describe_error

log = logging.getLogger(__name__)

CA_SECRET = "istio-ca-secret"
REQUEST_TIMEOUT = 10.0
SECRET_PATIENCE = 1200.0  # istiod gives up on its CA Secret after 20 minutes
SECRET_BACKOFF = Backoff(initial=0.5, cap=10.0)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoredRoot:
    """What the store holds: the root, its key, and the roots to trust (empty: the root alone)."""

    cert: bytes
    key: bytes
    roots: bytes = b""


def self_signed_root(trust_domain: str, now: datetime, ttl: timedelta) -> StoredRoot:
    """A new root as istiod makes it: RSA 2048, subject O=<trust domain>."""
    key = new_key()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, trust_domain)])
    subject_key = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return StoredRoot(cert_pem(_root_cert(key, name, now, ttl, subject_key)).encode(), key_pem(key))


def _root_cert(key: PrivateKey, name: x509.Name, now: datetime, ttl: timedelta,
               subject_key: x509.SubjectKeyIdentifier | None) -> x509.Certificate:
    """`subject_key` None: a root without one (a rotated root whose predecessor had none)."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + ttl)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(key_usage(ca=True), critical=True)
    )
    if subject_key is not None:
        builder = builder.add_extension(subject_key, critical=False)
    return builder.sign(key, hashes.SHA256())


def needs_rotation(root: x509.Certificate, now: datetime, grace_percent: int) -> bool:
    """istiod's test: expired, or less than `grace_percent` of the root's lifetime left."""
    lifetime = root.not_valid_after_utc - root.not_valid_before_utc
    return root.not_valid_after_utc - now <= lifetime * grace_percent / 100


def rotated(stored: StoredRoot, now: datetime, ttl: timedelta) -> StoredRoot:
    """A new root from the stored one's key, subject and key identifier (a root another tool made may
    have hashed the key differently: leaves carry it as their authority key identifier, and BoringSSL
    chains them only to a root with the same); the old one stays trusted while it is valid."""
    old = load_certs(stored.cert, CA_CERT_FILE)[0]
    new = _root_cert(load_key(stored.key, CA_KEY_FILE), old.subject, now, ttl, subject_key_identifier(old))
    kept = [old] if old.not_valid_after_utc > now else []
    return StoredRoot(cert_pem(new).encode(), stored.key, "".join(map(cert_pem, [new, *kept])).encode())


def stored_bundle(stored: StoredRoot, now: datetime) -> CaBundle:
    """The bundle in force: the stored root signs; it and every other stored root still valid are trusted."""
    cert = load_certs(stored.cert, CA_CERT_FILE)[0]
    others = load_certs(stored.roots, ROOT_CERT_FILE) if stored.roots.strip() else []
    roots = [cert, *(r for r in others if r != cert and r.not_valid_after_utc > now)]
    return bundle_from_pem(stored.cert, stored.key, b"", "".join(map(cert_pem, roots)).encode())


class RootStore(Protocol):
    """Where the self-signed root persists."""

    where: str

    async def load_or_create(self, create: Callable[[], StoredRoot]) -> StoredRoot:
        """The stored root; `create` runs only if there is none yet."""
        ...

    async def load(self) -> StoredRoot: ...

    async def replace(self, current: StoredRoot, new: StoredRoot) -> StoredRoot:
        """Store `new` if `current` is still what is stored; return what is stored after."""
        ...


class DirRootStore:
    """Config-dir mode: `<state dir>/istio-ca-secret/{ca-cert.pem,ca-key.pem,root-cert.pem}`."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / CA_SECRET
        self.where = str(self.path)

    async def load_or_create(self, create: Callable[[], StoredRoot]) -> StoredRoot:
        return await asyncio.to_thread(self._load_or_create, create)

    async def load(self) -> StoredRoot:
        return await asyncio.to_thread(self._load)

    async def replace(self, current: StoredRoot, new: StoredRoot) -> StoredRoot:
        return await asyncio.to_thread(self._replace, current, new)

    def _load_or_create(self, create: Callable[[], StoredRoot]) -> StoredRoot:
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".ca-", dir=self.path.parent))
            stored = create()
            (staging / CA_CERT_FILE).write_bytes(stored.cert)
            key_file = staging / CA_KEY_FILE
            key_file.touch(mode=0o600)
            key_file.write_bytes(stored.key)
            try:
                # Renaming a directory onto a non-empty one fails: the first istiod to get here wins.
                os.rename(staging, self.path)
                log.info("created a self-signed root CA in %s", self.path)
            except OSError:
                shutil.rmtree(staging)
        return self._load()

    def _load(self) -> StoredRoot:
        roots = self.path / ROOT_CERT_FILE
        return StoredRoot((self.path / CA_CERT_FILE).read_bytes(), (self.path / CA_KEY_FILE).read_bytes(),
                          roots.read_bytes() if roots.exists() else b"")

    def _replace(self, current: StoredRoot, new: StoredRoot) -> StoredRoot:
        if self._load().cert != current.cert:
            return self._load()
        # The key stays; the roots go first, so a reader in between sees the old root among them.
        write_atomic(self.path / ROOT_CERT_FILE, new.roots)
        write_atomic(self.path / CA_CERT_FILE, new.cert)
        return new


class SecretRootStore:
    """Kubernetes: Secret `istio-ca-secret` in istiod's namespace, created only if absent.

    Needs no leader: a create that finds the Secret already there (409) reads the winner's, an
    update that finds it changed (409) adopts it. At start API errors are retried with backoff for
    up to 20 minutes, as istiod does, so a replica that starts before the API server answers, or
    before its RBAC is in place, still starts.
    """

    def __init__(self, core: client.CoreV1Api, namespace: str) -> None:
        self.core = core
        self.namespace = namespace
        self.where = f"Secret {namespace}/{CA_SECRET}"

    async def load_or_create(self, create: Callable[[], StoredRoot]) -> StoredRoot:
        return await self._patiently("read or create", lambda: self._load_or_create(create))

    async def load(self) -> StoredRoot:
        return _stored(await self._read())

    async def replace(self, current: StoredRoot, new: StoredRoot) -> StoredRoot:
        return await self._patiently("update", lambda: self._replace(current, new))

    async def _patiently(self, doing: str, call: Callable[[], Awaitable[T]]) -> T:
        deadline = time.monotonic() + SECRET_PATIENCE
        attempt = 0
        while True:
            try:
                return await call()
            except API_ERRORS as error:
                reason = describe_error(error)
                if time.monotonic() >= deadline:
                    raise ValueError(f"cannot {doing} {self.where} for {SECRET_PATIENCE:g}s: {reason}") from None
                delay = SECRET_BACKOFF.delay(attempt)
                attempt += 1
                log.warning("CA root: cannot %s %s: %s; retrying in %.1fs", doing, self.where, reason, delay)
                await asyncio.sleep(delay)

    async def _load_or_create(self, create: Callable[[], StoredRoot]) -> StoredRoot:
        try:
            return _stored(await self._read())
        except ApiException as error:
            if error.status != 404:
                raise
        stored = create()
        data = {CA_CERT_FILE: stored.cert, CA_KEY_FILE: stored.key, CERT_CHAIN_FILE: b"", ROOT_CERT_FILE: stored.roots}
        secret = client.V1Secret(
            metadata=client.V1ObjectMeta(name=CA_SECRET, namespace=self.namespace),
            type="istio.io/ca-root",
            data={k: base64.b64encode(v).decode() for k, v in data.items()},
        )
        try:
            await self.core.create_namespaced_secret(self.namespace, secret, _request_timeout=REQUEST_TIMEOUT)
            log.info("created a self-signed root CA in %s", self.where)
            return stored
        except ApiException as error:
            if error.status != 409:
                raise
        # Another replica created it between our read and create: use theirs.
        return _stored(await self._read())

    async def _replace(self, current: StoredRoot, new: StoredRoot) -> StoredRoot:
        """An update carrying the resourceVersion just read: a replica that rotated meanwhile wins (409)."""
        secret = await self._read()
        if _stored(secret) != current:
            return _stored(secret)
        secret.data = {**secret.data, CA_CERT_FILE: base64.b64encode(new.cert).decode(),
                       ROOT_CERT_FILE: base64.b64encode(new.roots).decode()}
        try:
            await self.core.replace_namespaced_secret(CA_SECRET, self.namespace, secret, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as error:
            if error.status != 409:
                raise
            return _stored(await self._read())  # another replica rotated first: theirs is the root
        return new

    async def _read(self) -> client.V1Secret:
        return await self.core.read_namespaced_secret(CA_SECRET, self.namespace, _request_timeout=REQUEST_TIMEOUT)


def _stored(secret: object) -> StoredRoot:
    data = getattr(secret, "data", None) or {}
    if CA_CERT_FILE not in data or CA_KEY_FILE not in data:
        raise ValueError(f"Secret {CA_SECRET} has no {CA_CERT_FILE} or {CA_KEY_FILE}")
    return StoredRoot(base64.b64decode(data[CA_CERT_FILE]), base64.b64decode(data[CA_KEY_FILE]),
                      base64.b64decode(data.get(ROOT_CERT_FILE) or b""))


async def self_signed_bundle(store: RootStore, trust_domain: str, policy: RootPolicy = RootPolicy()) -> CaBundle:
    """The stored root, created if absent, rotated first if it is due (an expired one included:
    istiod then starts, and says what that means for workloads)."""
    stored = await store.load_or_create(lambda: self_signed_root(trust_domain, datetime.now(timezone.utc), policy.ttl))
    try:
        old = load_certs(stored.cert, CA_CERT_FILE)[0]
        now = datetime.now(timezone.utc)
        if needs_rotation(old, now, policy.grace_percent):
            stored = await store.replace(stored, rotated(stored, now, policy.ttl))
            bundle = stored_bundle(stored, now)
            if old.not_valid_after_utc <= now:
                log.warning("the self-signed root in %s expired at %s: replaced by a new root of the same key "
                            "(serial %x), valid until %s; workloads get certificates from it at their next request, "
                            "restart those that gave up", store.where, old.not_valid_after_utc.isoformat(),
                            bundle.root.serial_number, bundle.root.not_valid_after_utc.isoformat())
            else:
                _log_rotation(old, bundle, store.where)
            return bundle
        return stored_bundle(stored, now)
    except ValueError as error:
        raise ValueError(f"the root CA in {store.where} is unusable: {error}") from None


class RootRotator:
    """Checks the stored root every interval; rotates it when due, adopts another replica's rotation."""

    def __init__(self, store: RootStore, ca: CertificateAuthority, policy: RootPolicy,
                 on_change: Callable[[CaBundle], None]) -> None:
        self.store = store
        self.ca = ca
        self.policy = policy
        self.on_change = on_change

    async def run(self) -> None:
        # As istiod's jitter: replicas started together do not check (and rotate) together.
        await asyncio.sleep(random.uniform(0, self.policy.check_interval))
        while True:
            try:
                await self.check()
            except (*API_ERRORS, OSError, ValueError) as error:
                log.error(logs.event("root rotation check failed; trying again at the next check",
                                     store=self.store.where, error=describe_error(error)))
            await asyncio.sleep(self.policy.check_interval)

    async def check(self) -> None:
        stored = await self.store.load()
        now = datetime.now(timezone.utc)
        current = self.ca.bundle
        if needs_rotation(load_certs(stored.cert, CA_CERT_FILE)[0], now, self.policy.grace_percent):
            stored = await self.store.replace(stored, rotated(stored, now, self.policy.ttl))
        bundle = stored_bundle(stored, now)
        if bundle.cert == current.cert and bundle.roots == current.roots:
            return
        self.ca.bundle = bundle
        if bundle.cert != current.cert:
            _log_rotation(current.cert, bundle, self.store.where)
        else:
            log.info(logs.event("root CA: an expired root left the trust bundle", roots=len(bundle.roots)))
        self.on_change(bundle)


def _log_rotation(old: x509.Certificate, bundle: CaBundle, where: str) -> None:
    log.info(logs.event("root CA rotated", store=where, old_serial=f"{old.serial_number:x}",
                        old_expires=old.not_valid_after_utc.isoformat(), serial=f"{bundle.root.serial_number:x}",
                        expires=bundle.root.not_valid_after_utc.isoformat(), trusted_roots=len(bundle.roots)))

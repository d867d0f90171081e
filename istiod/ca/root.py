"""The CA's root of trust: the bundle in force, from a plugged-in CA or the self-signed root.

A plugged-in CA is read from `ca-cert.pem`, `ca-key.pem`, `cert-chain.pem` and `root-cert.pem` and
reloaded when those files change; the self-signed root (istiod/ca/selfsigned.py) is rotated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from istiod import metrics
from istiod.ca.pki import PrivateKey, cert_pem, load_certs, load_key, same_public_key
from istiod.certfiles import CERT_CHAIN_FILE, ROOT_CERT_FILE

log = logging.getLogger(__name__)

CA_CERT_FILE = "ca-cert.pem"
CA_KEY_FILE = "ca-key.pem"


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

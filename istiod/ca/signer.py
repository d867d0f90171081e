"""CSR checks and certificate issuance. Pure: (CA bundle, request, caller, clock) -> certificates.

As istiod's CA: the identity in the certificate is the authenticated caller's, never the CSR's SANs;
the CSR contributes only its (signature-checked) public key.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from istiod.ca.pki import cert_pem, key_usage, subject_key_identifier
from istiod.ca.root import CaBundle
from istiod.durations import go_duration

CSR_MARKER = b"-----BEGIN CERTIFICATE REQUEST-----"
MAX_CSR_BYTES = 64 * 1024  # a workload's CSR is about 1 KiB; refuse big ones before parsing them
PublicKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey


class SignErrorKind(enum.Enum):
    """Istio's caerror types; the CA service maps them to gRPC codes and metrics."""

    CSR = "CSR_ERROR"
    TTL = "TTL_ERROR"
    CERT_GEN = "CERT_GEN_ERROR"


class SignError(Exception):
    def __init__(self, kind: SignErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class TtlPolicy:
    default: timedelta = timedelta(hours=24)
    max: timedelta = timedelta(days=90)


def parse_csr(pem: str) -> x509.CertificateSigningRequest:
    data = pem.encode()
    if len(data) > MAX_CSR_BYTES:
        raise SignError(SignErrorKind.CSR, f"certificate signing request is {len(data)} bytes, over the limit of {MAX_CSR_BYTES}")
    if CSR_MARKER not in data:
        raise SignError(SignErrorKind.CSR, "certificate signing request is not properly encoded")
    try:
        csr = x509.load_pem_x509_csr(data)
    except ValueError:
        raise SignError(SignErrorKind.CSR, "failed to parse X.509 certificate signing request") from None
    if not csr.is_signature_valid:
        raise SignError(SignErrorKind.CSR, "certificate signing request signature does not match its public key")
    return csr


def lifetime(requested_seconds: int, policy: TtlPolicy) -> timedelta:
    """0 (or less) asks for the default; more than the max is refused, as istiod does."""
    if requested_seconds <= 0:
        return policy.default
    # Compared as integers: an int64 of seconds overflows timedelta long before it reaches its max.
    if requested_seconds > policy.max.total_seconds():
        raise SignError(
            SignErrorKind.TTL,
            f"requested TTL {go_duration(requested_seconds)} is greater than the max allowed TTL "
            f"{go_duration(policy.max.total_seconds())}",
        )
    return timedelta(seconds=requested_seconds)


def issue(bundle: CaBundle, public_key: object, names: list[x509.GeneralName], not_before: datetime,
          ttl: timedelta) -> x509.Certificate:
    """A leaf for both client and server use. It never outlives the certificate that signs it."""
    if not isinstance(public_key, (rsa.RSAPublicKey, ec.EllipticCurvePublicKey)):
        raise SignError(SignErrorKind.CSR, "only RSA and ECDSA public keys are supported")
    not_after = min(not_before + ttl, bundle.cert.not_valid_after_utc)
    # Istio leaves the subject empty, which RFC 5280 allows only with a critical SAN extension.
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(bundle.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(names), critical=True)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
    )
    authority = authority_key_identifier(bundle.cert)
    if authority is not None:
        builder = builder.add_extension(authority, critical=False)
    return builder.sign(bundle.key, hashes.SHA256())


def authority_key_identifier(issuer: x509.Certificate) -> x509.AuthorityKeyIdentifier | None:
    """The issuer's Subject Key Identifier copied, as Go's x509 does; None for an issuer without one.

    Never recomputed from the issuer's key: tools hash differently (Go 1.25+ a truncated SHA-256,
    OpenSSL SHA-1, some none at all), and BoringSSL refuses a chain whose identifiers differ.
    """
    subject_key = subject_key_identifier(issuer)
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(subject_key) if subject_key else None


def sign_csr(bundle: CaBundle, csr_pem: str, identities: tuple[str, ...], requested_seconds: int,
             policy: TtlPolicy, now: datetime) -> list[str]:
    """The response's cert_chain as istiod's: the new leaf first, then the CA's chain, and last every
    root to trust in one entry (two during a root rotation), which agents write as root-cert.pem."""
    csr = parse_csr(csr_pem)
    ttl = lifetime(requested_seconds, policy)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity) for identity in identities]
    try:
        leaf = issue(bundle, csr.public_key(), names, now, ttl)
    except ValueError as error:
        raise SignError(SignErrorKind.CERT_GEN, f"failed to generate the certificate: {error}") from None
    return [cert_pem(leaf), *(cert_pem(c) for c in bundle.issuers[:-1]), bundle.roots_pem]

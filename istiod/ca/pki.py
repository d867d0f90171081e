"""PEM and key helpers shared by the CA, istiod's serving certificate and the agent (cryptography only)."""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
PEM_CERT_MARKER = b"-----BEGIN CERTIFICATE-----"


def new_key() -> rsa.RSAPrivateKey:
    """RSA 2048, Istio's default for roots, istiod and workloads."""
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def key_usage(ca: bool) -> x509.KeyUsage:
    """Istio's choices: a CA signs certificates and CRLs; a leaf signs and exchanges keys for TLS."""
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=not ca, data_encipherment=False,
        key_agreement=False, key_cert_sign=ca, crl_sign=ca, encipher_only=False, decipher_only=False,
    )


def cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def load_certs(data: bytes, what: str) -> list[x509.Certificate]:
    """Every certificate in a PEM blob; ValueError naming `what` if there is none or one is broken."""
    if PEM_CERT_MARKER not in data:
        raise ValueError(f"{what}: no PEM certificate found")
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None


def load_key(data: bytes, what: str) -> PrivateKey:
    """A PEM private key; the error never quotes the key's bytes."""
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ValueError(f"{what}: not a PEM private key without a password") from None
    if not isinstance(key, (rsa.RSAPrivateKey, ec.EllipticCurvePrivateKey)):
        raise ValueError(f"{what}: only RSA and ECDSA keys are supported")
    return key


def uri_sans(cert: x509.Certificate) -> list[str]:
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return names.get_values_for_type(x509.UniformResourceIdentifier)


def subject_key_identifier(cert: x509.Certificate) -> x509.SubjectKeyIdentifier | None:
    """The certificate's own Subject Key Identifier, as whatever tool made it computed it; None if absent."""
    try:
        return cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return None


def spki(public: object) -> bytes:
    """A public key's DER SubjectPublicKeyInfo."""
    return public.public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def same_public_key(key: PrivateKey, cert: x509.Certificate) -> bool:
    return spki(key.public_key()) == spki(cert.public_key())

"""Test certificates: roots, intermediates and CSRs made with cryptography, as an operator would."""

from __future__ import annotations

import ipaddress
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from istiod.ca.pki import PrivateKey, cert_pem, key_pem, new_key, spki

NOW = datetime.now(timezone.utc)
# How CA tools identify a key (RFC 5280 4.2.1.2, RFC 7093): Go 1.25+ takes the first 160 bits of a
# SHA-256 of the subjectPublicKey bits, OpenSSL (and cryptography) their SHA-1, and some tools none.
KEY_ID_STYLES = ("go", "openssl", "none")


def subject_key_id(key: PrivateKey, style: str) -> x509.SubjectKeyIdentifier | None:
    public = key.public_key()
    if style == "none":
        return None
    if style == "openssl":
        return x509.SubjectKeyIdentifier.from_public_key(public)
    assert style == "go", style
    bits = (public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.PKCS1)
            if isinstance(public, rsa.RSAPublicKey)
            else public.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint))
    digest = hashes.Hash(hashes.SHA256())
    digest.update(bits)
    return x509.SubjectKeyIdentifier(digest.finalize()[:20])


def ca_cert(name: str, key: PrivateKey, issuer: tuple[x509.Certificate, PrivateKey] | None = None,
            days: int = 365, key_ids: str = "openssl") -> x509.Certificate:
    """A root (or, with `issuer`, an intermediate) whose key identifiers are made as `key_ids` tools make them."""
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name)])
    issuer_name, signer = (issuer[0].subject, issuer[1]) if issuer else (subject, key)
    builder = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(NOW - timedelta(minutes=1))
        .not_valid_after(NOW + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
    )
    own = subject_key_id(key, key_ids)
    if own is not None:
        builder = builder.add_extension(own, critical=False)
    parent = subject_key_id(signer, key_ids) if issuer else None
    if parent is not None:
        builder = builder.add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(parent),
                                        critical=False)
    return builder.sign(signer, hashes.SHA256())


def write_plugged(directory: Path, name: str = "plugged", key_ids: str = "openssl",
                  intermediate: bool = True) -> tuple[x509.Certificate, x509.Certificate]:
    """A root and an intermediate that signs, as istio's `make` tooling lays out cacerts; without
    `intermediate` the root itself signs (as istiod's own istio-ca-secret). `key_ids`: see ca_cert."""
    root_key, inter_key = ec.generate_private_key(ec.SECP256R1()), new_key()
    root = ca_cert(f"{name} root", root_key, key_ids=key_ids)
    inter = ca_cert(f"{name} intermediate", inter_key, (root, root_key), key_ids=key_ids) if intermediate else root
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca-cert.pem").write_text(cert_pem(inter))
    (directory / "ca-key.pem").write_bytes(key_pem(inter_key if intermediate else root_key))
    (directory / "cert-chain.pem").write_text(cert_pem(inter) + cert_pem(root) if intermediate else cert_pem(root))
    (directory / "root-cert.pem").write_text(cert_pem(root))
    return root, inter


def csr_pem(key: PrivateKey, uri: str = "spiffe://cluster.local/ns/evil/sa/admin") -> str:
    csr = (
        x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def csr_claiming_other_key(signer: PrivateKey, claimed: PrivateKey) -> str:
    """A CSR that carries `claimed`'s public key but is signed by `signer` (same-size RSA keys)."""
    ours, theirs = spki(signer.public_key()), spki(claimed.public_key())
    der = x509.load_pem_x509_csr(csr_pem(signer).encode()).public_bytes(serialization.Encoding.DER)
    assert len(ours) == len(theirs) and ours in der
    forged = x509.load_der_x509_csr(der.replace(ours, theirs))
    return forged.public_bytes(serialization.Encoding.PEM).decode()


def leaf_cert(key: PrivateKey, issuer: tuple[x509.Certificate, PrivateKey], uris: tuple[str, ...] = (),
              dns: tuple[str, ...] = (), days: int = 1, ips: tuple[str, ...] = ()) -> x509.Certificate:
    """A workload (SPIFFE `uris`) or server (`dns`, `ips`) certificate signed by `issuer`."""
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    names += [x509.DNSName(d) for d in dns]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    return (
        x509.CertificateBuilder().subject_name(x509.Name([])).issuer_name(issuer[0].subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(NOW - timedelta(minutes=1)).not_valid_after(NOW + timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=True)
        .sign(issuer[1], hashes.SHA256())
    )

"""Test certificates: roots, intermediates and CSRs made with cryptography, as an operator would."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from istiod.ca.pki import PrivateKey, cert_pem, key_pem, new_key, spki

NOW = datetime.now(timezone.utc)


def ca_cert(name: str, key: PrivateKey, issuer: tuple[x509.Certificate, PrivateKey] | None = None,
            days: int = 365) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name)])
    issuer_name, signer = (issuer[0].subject, issuer[1]) if issuer else (subject, key)
    return (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(NOW - timedelta(minutes=1))
        .not_valid_after(NOW + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(signer, hashes.SHA256())
    )


def write_plugged(directory: Path, name: str = "plugged") -> tuple[x509.Certificate, x509.Certificate]:
    """A root and an intermediate that signs, as istio's `make` tooling lays out cacerts."""
    root_key, inter_key = ec.generate_private_key(ec.SECP256R1()), new_key()
    root = ca_cert(f"{name} root", root_key)
    inter = ca_cert(f"{name} intermediate", inter_key, (root, root_key))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca-cert.pem").write_text(cert_pem(inter))
    (directory / "ca-key.pem").write_bytes(key_pem(inter_key))
    (directory / "cert-chain.pem").write_text(cert_pem(inter) + cert_pem(root))
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
              dns: tuple[str, ...] = (), days: int = 1) -> x509.Certificate:
    """A workload (SPIFFE `uris`) or server (`dns`) certificate signed by `issuer`."""
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    names += [x509.DNSName(d) for d in dns]
    return (
        x509.CertificateBuilder().subject_name(x509.Name([])).issuer_name(issuer[0].subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(NOW - timedelta(minutes=1)).not_valid_after(NOW + timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=True)
        .sign(issuer[1], hashes.SHA256())
    )

"""A MUTUAL HTTPS server of an ingress gateway with two credentialNames (an RSA and an ECDSA
certificate) and clients pinned by verifyCertificateSpki/verifyCertificateHash, with a real Envoy
1.40 (the set-up of tests/test_envoy_gateway.py): a client that only admits RSA and one that only
admits ECDSA both complete TLS, each seeing its kind of certificate; a client certificate neither
pin names is refused, one each pin names accepted; a pinned certificate the CRL of the Secret
(`ca.crl`, as istiod reads a credential's CRL) revokes is refused. An ISTIO_MUTUAL server's `caCrl`
(a file Envoy reads) refuses a mesh client it revokes."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import ssl
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from istiod.ca.pki import cert_pem, key_pem
from tests.peers import free_port, wait_until
from tests.pki import NOW, ca_cert, leaf_cert
from tests.test_envoy_gateway import BIND, NAMESPACE, Gateway, gateway_envoy, mesh  # noqa: F401 (fixture)
from tests.test_gateway_gen import tls_secret

HOST = "secure.example.com"
CLIENTS = ("spki", "hash", "unlisted", "revoked")
RSA_ONLY, ECDSA_ONLY = "ECDHE-RSA-AES128-GCM-SHA256", "ECDHE-ECDSA-AES128-GCM-SHA256"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _objects(port: int, client_ca: bytes, crl: bytes, spki: list[str], cert_hash: str) -> list[dict[str, Any]]:
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "web-rsa-cacert", "namespace": NAMESPACE},
         "data": {"ca.crt": _b64(client_ca), "ca.crl": _b64(crl)}},
        {"apiVersion": "networking.istio.io/v1", "kind": "Gateway", "metadata": {"name": "certs", "namespace": NAMESPACE},
         "spec": {"selector": {"istio": "ingressgateway"}, "servers": [
             {"port": {"number": port, "name": "https-pinned", "protocol": "HTTPS"}, "bind": BIND,
              "hosts": [f"shop/{HOST}"],
              "tls": {"mode": "MUTUAL", "credentialNames": ["web-rsa", "web-ecdsa"],
                      "verifyCertificateSpki": spki, "verifyCertificateHash": [cert_hash]}}]}},
        {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": "certs", "namespace": "shop"},
         "spec": {"hosts": [HOST], "gateways": [f"{NAMESPACE}/certs"], "http": [{"route": [{"destination": {"host": "web"}}]}]}},
    ]


class Certs:
    def __init__(self, gateway: Gateway, workdir: Path, port: int) -> None:
        self.gateway, self.workdir, self.port = gateway, workdir, port

    def get(self, client: str, ciphers: str = "") -> tuple[str, str]:
        """(the server certificate's key kind, the response) of a GET over TLS 1.2 presenting `client`'s
        certificate, with only `ciphers` offered; ("", the error) when TLS or the request failed."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(str(self.workdir / "server-ca.pem"))
        context.maximum_version = ssl.TLSVersion.TLSv1_2  # TLS 1.2: the cipher suite names the certificate's kind
        if ciphers:
            context.set_ciphers(ciphers)
        context.load_cert_chain(str(self.workdir / f"{client}.pem"), str(self.workdir / f"{client}-key.pem"))
        try:
            with socket.create_connection((BIND, self.port), timeout=5) as raw, \
                    context.wrap_socket(raw, server_hostname=HOST) as tls:
                der = tls.getpeercert(binary_form=True)
                assert der is not None
                kind = "RSA" if isinstance(x509.load_der_x509_certificate(der).public_key(), rsa.RSAPublicKey) else "ECDSA"
                tls.sendall(f"GET /pinned HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
                reply = b"".join(iter(lambda: tls.recv(4096), b"")).decode()
        except (OSError, ssl.SSLError) as error:
            return "", f"error: {error}"
        return (kind, reply) if reply.startswith("HTTP/1.1 200") else ("", reply or "error: closed")


@pytest.fixture
def certs(mesh: Gateway, mesh_dir: Path) -> Iterator[Certs]:  # noqa: F811 (the fixture)
    workdir = mesh_dir.parent
    server_ca_key = ec.generate_private_key(ec.SECP256R1())
    server_ca = ca_cert("gateway servers", server_ca_key)
    (workdir / "server-ca.pem").write_text(cert_pem(server_ca))
    secrets = []
    for name, key in (("web-rsa", rsa.generate_private_key(65537, 2048)), ("web-ecdsa", ec.generate_private_key(ec.SECP256R1()))):
        cert = cert_pem(leaf_cert(key, (server_ca, server_ca_key), dns=(HOST,))).encode()
        secrets.append(tls_secret(name, NAMESPACE, cert, key_pem(key)))
    client_ca_key = ec.generate_private_key(ec.SECP256R1())
    client_ca = ca_cert("gateway clients", client_ca_key)
    issued: dict[str, x509.Certificate] = {}
    for name in CLIENTS:
        key = ec.generate_private_key(ec.SECP256R1())
        issued[name] = leaf_cert(key, (client_ca, client_ca_key), dns=(f"{name}.client",))
        (workdir / f"{name}.pem").write_text(cert_pem(issued[name]))
        (workdir / f"{name}-key.pem").write_bytes(key_pem(key))
    revoked = (x509.RevokedCertificateBuilder().serial_number(issued["revoked"].serial_number)
               .revocation_date(NOW - timedelta(minutes=1)).build())
    crl = (x509.CertificateRevocationListBuilder().issuer_name(client_ca.subject).last_update(NOW - timedelta(minutes=1))
           .next_update(NOW + timedelta(days=1)).add_revoked_certificate(revoked).sign(client_ca_key, hashes.SHA256()))

    def spki(cert: x509.Certificate) -> str:
        der = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        return _b64(hashlib.sha256(der).digest())

    # `revoked` is pinned too (by its SPKI): only the CRL refuses it.
    cert_hash = hashlib.sha256(issued["hash"].public_bytes(serialization.Encoding.DER)).hexdigest()
    port = free_port(BIND)
    objects = _objects(port, cert_pem(client_ca).encode(), crl.public_bytes(serialization.Encoding.PEM),
                       [spki(issued["spki"]), spki(issued["revoked"])], cert_hash)
    (mesh_dir / "certs.yaml").write_text(yaml.safe_dump_all([*secrets, *objects]))
    with gateway_envoy(mesh) as started:
        yield Certs(started, workdir, port)


def test_two_credential_names_serve_an_rsa_only_and_an_ecdsa_only_client(certs: Certs) -> None:
    kind, reply = wait_until(lambda: (r := certs.get("spki", RSA_ONLY))[0] and r, 15, "TLS with an RSA-only client")
    print("RSA-only client:", kind, reply.splitlines()[0])
    assert kind == "RSA" and json.loads(reply.split("\r\n\r\n", 1)[1])["path"] == "/pinned"
    kind, reply = certs.get("spki", ECDSA_ONLY)
    print("ECDSA-only client:", kind, reply.splitlines()[0])
    assert kind == "ECDSA"


def test_client_certificates_are_pinned_by_spki_and_hash_and_the_crl_refuses(certs: Certs) -> None:
    wait_until(lambda: certs.get("spki")[0], 15, "a client of a pinned SPKI")
    results = {name: certs.get(name) for name in CLIENTS}
    for name, (kind, reply) in results.items():
        print(f"client {name}:", kind or "refused", reply.splitlines()[0][:100])
    assert results["spki"][0] and results["hash"][0]
    # The backend is told the client's certificate (istiod's SANITIZE_SET at gateways).
    xfcc = json.loads(results["spki"][1].split("\r\n\r\n", 1)[1])["xfcc"]
    print("x-forwarded-client-cert:", xfcc[:160])
    assert "Hash=" in xfcc and "DNS=spki.client" in xfcc and "Cert=" in xfcc
    assert not results["unlisted"][0]  # signed by the CA, but neither pin names it
    assert not results["revoked"][0]  # pinned, but the Secret's ca.crl revokes it


def _crl(issuer: x509.Certificate, key: Any, *revoked: x509.Certificate) -> bytes:
    builder = (x509.CertificateRevocationListBuilder().issuer_name(issuer.subject)
               .last_update(NOW - timedelta(minutes=1)).next_update(NOW + timedelta(days=1)))
    for cert in revoked:
        builder = builder.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(cert.serial_number)
                                                  .revocation_date(NOW - timedelta(minutes=1)).build())
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_istio_mutual_ca_crl_refuses_a_revoked_mesh_client(mesh: Gateway, mesh_dir: Path) -> None:  # noqa: F811
    """caCrl with ISTIO_MUTUAL (istiod's ApplyToCommonTLSContext): the CRL file joins the mesh root's
    validation; a mesh client certificate it revokes is refused, another one served."""
    workdir, port = mesh_dir.parent, free_port(BIND)
    with gateway_envoy(mesh) as started:
        assert started.sds is not None
        signer = (started.sds.root, started.sds.root_key)
        issued = {}
        for name in ("member", "revoked"):
            key = ec.generate_private_key(ec.SECP256R1())
            issued[name] = leaf_cert(key, signer, uris=(f"spiffe://cluster.local/ns/shop/sa/{name}",))
            (workdir / f"{name}.pem").write_text(cert_pem(issued[name]))
            (workdir / f"{name}-key.pem").write_bytes(key_pem(key))
        (workdir / "mesh.crl").write_bytes(_crl(started.sds.root, started.sds.root_key, issued["revoked"]))
        (mesh_dir / "crl.yaml").write_text(yaml.safe_dump_all([
            {"apiVersion": "networking.istio.io/v1", "kind": "Gateway", "metadata": {"name": "crl", "namespace": NAMESPACE},
             "spec": {"selector": {"istio": "ingressgateway"}, "servers": [
                 {"port": {"number": port, "name": "https-mesh", "protocol": "HTTPS"}, "bind": BIND, "hosts": [f"shop/{HOST}"],
                  "tls": {"mode": "ISTIO_MUTUAL", "caCrl": str(workdir / "mesh.crl")}}]}},
            {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": "crl", "namespace": "shop"},
             "spec": {"hosts": [HOST], "gateways": [f"{NAMESPACE}/crl"], "http": [{"route": [{"destination": {"host": "web"}}]}]}}]))
        # -k: the gateway presents its workload certificate (a SPIFFE ID, no DNS name), as istiod's would.
        args = (f"https://{HOST}:{port}/crl", "--resolve", f"{HOST}:{port}:{BIND}", "-k")

        def client(name: str) -> tuple[str, ...]:
            return "--cert", str(workdir / f"{name}.pem"), "--key", str(workdir / f"{name}-key.pem")

        status, body = wait_until(lambda: (r := started.curl(*args, *client("member")))[0] == 200 and r, 15,
                                  "ISTIO_MUTUAL with a mesh client the CRL does not revoke")
        print("caCrl, member:", status, body[:60])
        status, body = started.curl(*args, *client("revoked"))
        print("caCrl, revoked:", status, body.strip()[:120])
        assert status == 0

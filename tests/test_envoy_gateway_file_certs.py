"""Gateway servers whose certificates are files in the gateway's pod, with a real Envoy 1.40 run by
`istiod agent proxy router` (the set-up of tests/test_envoy_gateway.py): istiod names the files as
`file-cert:<cert>~<key>` and `file-root:<ca>` and the agent serves them over its SDS. A SIMPLE server
presents its file's certificate; a MUTUAL server with caCertificates refuses a client without a
certificate and serves one the CA signed; tlsCertificates with an RSA and an ECDSA pair serve an
RSA-only and an ECDSA-only client; replacing the files changes the served certificate without a restart.
A server whose files are missing at start does not keep the gateway unready (the agent names the
file, the others are served) and is served once they appear."""

from __future__ import annotations

import json
import os
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import Encoding

from istiod.ca.pki import cert_pem, key_pem
from tests.peers import Process, free_port, wait_until
from tests.pki import ca_cert, leaf_cert
from tests.test_envoy_gateway import BIND, NAMESPACE, Gateway, agent_gateway, mesh  # noqa: F401 (fixture)
from tests.test_envoy_gateway_certs import ECDSA_ONLY, RSA_ONLY

HOST = "files.example.com"
SERVERS = ("simple", "mutual", "pair")


def _objects(ports: dict[str, int], certs: Path) -> list[dict[str, Any]]:
    def server(name: str, tls: dict[str, Any]) -> dict[str, Any]:
        return {"port": {"number": ports[name], "name": f"https-{name}", "protocol": "HTTPS"}, "bind": BIND,
                "hosts": [f"shop/{HOST}"], "tls": tls}

    return [
        {"apiVersion": "networking.istio.io/v1", "kind": "Gateway", "metadata": {"name": "files", "namespace": NAMESPACE},
         "spec": {"selector": {"istio": "ingressgateway"}, "servers": [
             server("simple", {"mode": "SIMPLE", "serverCertificate": f"{certs}/tls.crt", "privateKey": f"{certs}/tls.key"}),
             server("mutual", {"mode": "MUTUAL", "serverCertificate": f"{certs}/tls.crt", "privateKey": f"{certs}/tls.key",
                               "caCertificates": f"{certs}/client-ca.crt"}),
             server("pair", {"mode": "SIMPLE", "tlsCertificates": [
                 {"serverCertificate": f"{certs}/rsa.crt", "privateKey": f"{certs}/rsa.key"},
                 {"serverCertificate": f"{certs}/ecdsa.crt", "privateKey": f"{certs}/ecdsa.key"}]}),
             # Files not there (yet) at start: a volume not mounted yet, a typo fixed later.
             *([server("late", {"mode": "SIMPLE", "serverCertificate": f"{certs}/late.crt",
                                "privateKey": f"{certs}/late.key"})] if "late" in ports else [])]}},
        {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": "files", "namespace": "shop"},
         "spec": {"hosts": [HOST], "gateways": [f"{NAMESPACE}/files"], "http": [{"route": [{"destination": {"host": "web"}}]}]}},
    ]


@dataclass
class Files:
    certs: Path  # the files the Gateway names, as if mounted into the gateway's pod
    mesh_dir: Path  # what istiod reads
    ports: dict[str, int]
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey]  # signs the servers' certificates
    agent: Process | None = None  # `istiod agent proxy router`, once started

    def write(self, name: str, key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> x509.Certificate:
        """A new certificate for HOST in `<name>.crt` and its key in `<name>.key`, each replaced at once."""
        cert = leaf_cert(key, self.issuer, dns=(HOST,))
        for suffix, data in (("crt", cert_pem(cert).encode()), ("key", key_pem(key))):
            part = self.certs / f".{name}.{suffix}.new"
            part.write_bytes(data)
            os.replace(part, self.certs / f"{name}.{suffix}")
        return cert

    def get(self, server: str, client: str = "", ciphers: str = "") -> tuple[x509.Certificate | None, str]:
        """(the server's certificate, the response's first line) of a GET over TLS 1.2 to `server`,
        presenting `client`'s certificate if named, offering only `ciphers` if given; (None, the
        error) when TLS or the request failed."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(str(self.certs / "server-ca.crt"))
        context.maximum_version = ssl.TLSVersion.TLSv1_2  # TLS 1.2: the cipher suite names the certificate's kind
        if ciphers:
            context.set_ciphers(ciphers)
        if client:
            context.load_cert_chain(str(self.certs / f"{client}.crt"), str(self.certs / f"{client}.key"))
        try:
            with socket.create_connection((BIND, self.ports[server]), timeout=5) as raw, \
                    context.wrap_socket(raw, server_hostname=HOST) as tls:
                der = tls.getpeercert(binary_form=True)
                assert der is not None
                tls.sendall(f"GET /{server} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
                reply = b"".join(iter(lambda: tls.recv(4096), b"")).decode()
        except (OSError, ssl.SSLError) as error:
            return None, f"error: {error}"
        first = reply.split("\r\n", 1)[0]
        return (x509.load_der_x509_certificate(der), first) if first.startswith("HTTP/1.1 200") else (None, first or "closed")


@pytest.fixture
def files(mesh: Gateway, processes: list[Process], tmp_path: Path,  # noqa: F811 (the fixture)
          request: pytest.FixtureRequest) -> Iterator[Files]:
    """SERVERS, and those `request.param` names (served files not written)."""
    certs = tmp_path / "gateway-certs"
    certs.mkdir()
    server_ca_key = ec.generate_private_key(ec.SECP256R1())
    server_ca = ca_cert("gateway file certificates", server_ca_key)
    (certs / "server-ca.crt").write_text(cert_pem(server_ca))
    found = Files(certs, mesh.mesh_dir, {name: free_port(BIND) for name in (*SERVERS, *getattr(request, "param", ()))}, (server_ca, server_ca_key))
    found.write("tls", ec.generate_private_key(ec.SECP256R1()))
    found.write("rsa", rsa.generate_private_key(65537, 2048))
    found.write("ecdsa", ec.generate_private_key(ec.SECP256R1()))
    client_ca_key = ec.generate_private_key(ec.SECP256R1())
    client_ca = ca_cert("gateway clients", client_ca_key)
    (certs / "client-ca.crt").write_text(cert_pem(client_ca))
    client_key = ec.generate_private_key(ec.SECP256R1())
    (certs / "client.crt").write_text(cert_pem(leaf_cert(client_key, (client_ca, client_ca_key), dns=("client.test",))))
    (certs / "client.key").write_bytes(key_pem(client_key))
    (mesh.mesh_dir / "files.yaml").write_text(yaml.safe_dump_all(_objects(found.ports, certs)))
    with agent_gateway(mesh, processes, {"istio": "ingressgateway"}) as found.agent:
        yield found


def test_simple_and_mutual_servers_from_files_and_rotation(files: Files) -> None:
    served, line = wait_until(lambda: (r := files.get("simple"))[0] and r, 20, "the SIMPLE server from files")
    print("SIMPLE from files:", line, served.serial_number)
    assert served.public_bytes(Encoding.PEM) == (files.certs / "tls.crt").read_bytes()

    # MUTUAL with caCertificates: a client without a certificate is refused, one the CA signed served.
    refused, error = files.get("mutual")
    print("MUTUAL without a client certificate:", error)
    assert refused is None
    served, line = wait_until(lambda: (r := files.get("mutual", "client"))[0] and r, 10, "the MUTUAL server")
    print("MUTUAL with a client certificate:", line)
    assert served.serial_number == x509.load_pem_x509_certificate((files.certs / "tls.crt").read_bytes()).serial_number

    # The files replaced (a Secret volume updated): the agent pushes them, Envoy serves them, no restart.
    assert files.agent is not None
    agent = files.agent
    rotated = files.write("tls", ec.generate_private_key(ec.SECP256R1()))
    wait_until(lambda: (c := files.get("simple")[0]) is not None and c.serial_number == rotated.serial_number, 15,
               "the replaced certificate served")
    print("after replacing the files, served serial:", rotated.serial_number)
    assert files.get("mutual", "client")[0].serial_number == rotated.serial_number  # type: ignore[union-attr]
    assert agent.text().count("Envoy started pid=") == 1
    assert "PRIVATE KEY" not in agent.text()


def test_tls_certificates_serve_an_rsa_only_and_an_ecdsa_only_client(files: Files) -> None:
    served, line = wait_until(lambda: (r := files.get("pair", ciphers=RSA_ONLY))[0] and r, 20, "an RSA-only client")
    print("RSA-only client:", line, type(served.public_key()).__name__)
    assert isinstance(served.public_key(), rsa.RSAPublicKey)
    served, line = files.get("pair", ciphers=ECDSA_ONLY)
    assert served is not None, line
    print("ECDSA-only client:", line, type(served.public_key()).__name__)
    assert isinstance(served.public_key(), ec.EllipticCurvePublicKey)


@pytest.mark.parametrize("files", [("late",)], indirect=True)
def test_a_server_whose_files_are_missing_comes_up_without_and_is_served_once_they_appear(files: Files) -> None:
    """As istiod, Envoy's fetch timeout (15 s) for files: the gateway becomes ready, handshakes on the
    server without its files fail, the others are served; the agent names the file; once the files are
    there, the server presents them."""
    assert files.agent is not None
    agent = files.agent
    line = next(l for l in agent.output if "SDS: cannot read" in l)
    print("agent:", line.strip())
    assert f"{files.certs}/late.crt" in line
    assert files.get("late")[0] is None
    assert wait_until(lambda: files.get("simple")[0], 10, "the SIMPLE server from files") is not None  # the others go on
    written = files.write("late", ec.generate_private_key(ec.SECP256R1()))
    served, reply = wait_until(lambda: (r := files.get("late"))[0] and r, 40, "the server once its files appear")
    print("once the files are there:", reply)
    assert served.serial_number == written.serial_number

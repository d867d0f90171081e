"""Certificates from a CA that another tool made chain under BoringSSL.

A plugged-in CA whose key identifiers were made the three common ways (Go's truncated SHA-256,
OpenSSL's SHA-1, none): grpcio verifies istiod's serving certificate against the plugged root when it
asks for workload certificates, then a real Envoy uses two of them for mTLS between its own
listeners, each side verifying the other's chain. Every leaf's Authority Key Identifier is its
issuer's Subject Key Identifier, byte for byte. Then the real thing: roots made by a Go program
(tests/data/goroot, crypto/x509's own key identifier) and by the openssl command plugged in as
`cacerts`, and two pods running Istio's pilot-agent and Envoy (tests/istio_pods.py) calling each
other over mTLS with the certificates istiod signs under them.
"""

from __future__ import annotations

import http.client
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from istiod.ca.pki import key_pem, load_certs, new_key, subject_key_identifier
from tests.envoy_peer import Envoy
from tests.istio_pods import A_ID, HOST, istio_pods
from tests.peers import ROOT, free_port, wait_until
from tests.pki import KEY_ID_STYLES, csr_pem, subject_key_id, write_plugged
from tests.pods import admin, call, requires_root
from tests.secure_port import OTHER_TOKEN, TOKEN, Secure, start_secure
from tests.test_ca_service import create

WEB = "spiffe://cluster.local/ns/app/sa/web"
DB = "spiffe://cluster.local/ns/app/sa/db"
# (key identifier style, whether an intermediate signs): the root signing as istiod's own, and the
# usual cacerts layout with an intermediate.
CASES = [*((style, False) for style in KEY_ID_STYLES), ("go", True)]


@pytest.fixture(params=CASES, ids=[f"{style}{'-intermediate' if inter else '-root'}" for style, inter in CASES])
async def plugged(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Secure]:
    style, intermediate = request.param
    write_plugged(tmp_path / "cacerts", style, key_ids=style, intermediate=intermediate)
    secure = await start_secure(tmp_path / "istiod", plugged=tmp_path / "cacerts")
    yield secure
    await secure.port.stop()


def authority_key(cert: x509.Certificate) -> bytes | None:
    try:
        return cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier
    except x509.ExtensionNotFound:
        return None


def assert_chains_by_key_id(leaf: x509.Certificate, issuer: x509.Certificate) -> None:
    subject_key = subject_key_identifier(issuer)
    assert authority_key(leaf) == (subject_key.digest if subject_key else None)


def tls_context(directory: Path, peer: str) -> dict[str, Any]:
    return {
        "tls_certificates": [{"certificate_chain": {"filename": str(directory / "chain.pem")},
                              "private_key": {"filename": str(directory / "key.pem")}}],
        "validation_context": {"trusted_ca": {"filename": str(directory / "root.pem")},
                               "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": {"exact": peer}}]},
    }


def _listener(name: str, port: int, route: dict[str, Any], tls: dict[str, Any] | None = None) -> dict[str, Any]:
    listener: dict[str, Any] = {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": name,
            "route_config": {"virtual_hosts": [{"name": name, "domains": ["*"], "routes": [{"match": {"prefix": "/"}, **route}]}]},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        }}]}],
    }
    if tls is not None:
        listener["filter_chains"][0]["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext", **tls}}
    return listener


def mtls_envoy_config(workdir: Path, plain_port: int, mtls_port: int, client: Path, server: Path) -> dict[str, Any]:
    """Plain HTTP on `plain_port` -> mTLS as WEB -> `mtls_port` (requires a client certificate naming WEB,
    presents DB's) -> a direct 200 that echoes the client's verified identity."""
    return {
        "admin": {"address": {"pipe": {"path": str(workdir / "admin")}}},
        "static_resources": {
            "listeners": [
                _listener("plain", plain_port, {"route": {"cluster": "mtls"}}),
                _listener("mtls", mtls_port, {"direct_response": {"status": 200, "body": {"inline_string": "chained"}},
                                              "response_headers_to_add": [{"header": {
                                                  "key": "x-peer", "value": "%DOWNSTREAM_PEER_URI_SAN%"}}]},
                          {"require_client_certificate": True, "common_tls_context": tls_context(server, WEB)}),
            ],
            "clusters": [{
                "name": "mtls", "type": "STATIC", "connect_timeout": "2s",
                "load_assignment": {"cluster_name": "mtls", "endpoints": [{"lb_endpoints": [{"endpoint": {
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": mtls_port}}}}]}]},
                "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    "common_tls_context": tls_context(client, DB)}},
            }],
        },
    }


async def certify(secure: Secure, token: str, directory: Path) -> list[x509.Certificate]:
    """A workload certificate from the CA over grpcio's TLS (istiod's serving certificate verified
    against the plugged-in root), written as Envoy reads it; the chain as certificates."""
    key = new_key()
    chain = list((await create(secure, csr_pem(key), token=token)).cert_chain)
    directory.mkdir()
    (directory / "chain.pem").write_text("".join(chain[:-1]))
    (directory / "key.pem").write_bytes(key_pem(key))
    (directory / "root.pem").write_text(chain[-1])
    return [load_certs(pem.encode(), "chain")[0] for pem in chain]


async def test_workload_certificates_chain_in_envoy_whatever_made_the_root(plugged: Secure) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="envoy-chain-", dir="/tmp"))  # Unix socket paths must stay short
    envoy = None
    try:
        web = await certify(plugged, TOKEN, workdir / "web")
        await certify(plugged, OTHER_TOKEN, workdir / "db")
        assert plugged.port.ca is not None and plugged.port.serving is not None
        signer = plugged.port.ca.bundle.cert
        assert_chains_by_key_id(web[0], signer)
        assert plugged.port.serving.cert is not None
        assert_chains_by_key_id(plugged.port.serving.cert, signer)

        plain_port, mtls_port = free_port(), free_port()
        envoy = Envoy(mtls_envoy_config(workdir, plain_port, mtls_port, workdir / "web", workdir / "db"), workdir,
                      name="envoy-chain", netns=False)
        wait_until(lambda: envoy is not None and envoy.get("/ready")[0] == 200, 20, "Envoy's listeners")
        connection = http.client.HTTPConnection("127.0.0.1", plain_port, timeout=10)
        try:
            connection.request("GET", "/")
            reply = connection.getresponse()
            body = reply.read().decode()
        finally:
            connection.close()
        print(f"through Envoy's mTLS hop: {reply.status} {body!r} x-peer={reply.getheader('x-peer')}")
        assert (reply.status, body, reply.getheader("x-peer")) == (200, "chained", WEB), envoy.log()[-4000:]
    finally:
        if envoy is not None:
            envoy.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def go_root(directory: Path) -> None:
    """tests/data/goroot: crypto/x509 picks the key identifier (the Go toolchain caches the build)."""
    done = subprocess.run(["go", "run", ".", str(directory)], cwd=ROOT / "tests" / "data" / "goroot",
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def openssl_root(directory: Path) -> None:
    """`openssl req -x509` with its default extensions (a SHA-1 key identifier), the root signing."""
    directory.mkdir(parents=True)
    done = subprocess.run(
        ["openssl", "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", str(directory / "ca-key.pem"), "-out", str(directory / "ca-cert.pem"), "-days", "365",
         "-subj", "/O=openssl root", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for name in ("cert-chain.pem", "root-cert.pem"):
        shutil.copyfile(directory / "ca-cert.pem", directory / name)


@requires_root
@pytest.mark.parametrize("maker", ["go", "openssl"])
def test_pilot_agent_pods_talk_mtls_under_a_root_made_by(maker: str, tmp_path: Path) -> None:
    cacerts = tmp_path / "cacerts"
    (go_root if maker == "go" else openssl_root)(cacerts)
    root = x509.load_pem_x509_certificate((cacerts / "root-cert.pem").read_bytes())
    key = serialization.load_pem_private_key((cacerts / "ca-key.pem").read_bytes(), None)
    made = subject_key_identifier(root)
    expected = subject_key_id(key, maker)  # type: ignore[arg-type]
    assert made is not None and expected is not None and made.digest == expected.digest, maker
    with istio_pods(tmp_path / "mesh", "--plugged-ca-dir", str(cacerts)) as pods:
        reply = call(pods.a, "http-get", f"http://{HOST}:8080/chained")
        print(f"a-1 -> b-1 under the {maker} root:", reply)
        assert reply["ok"], reply
        assert f"URI={A_ID}" in reply["body"]["headers"].get("x-forwarded-client-cert", "")
        certs = json.loads(admin(pods.b, "/certs"))["certificates"]
        roots = {int(c["serial_number"], 16) for entry in certs for c in entry.get("ca_cert") or []}
        assert root.serial_number in roots, certs

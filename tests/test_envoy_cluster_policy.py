"""DestinationRule cluster settings carrying real traffic through a real Envoy sidecar configured
by istiod: ring hash and maglev keep a key on one backend, a cookie policy has Envoy set the cookie
with its attributes, the PROXY protocol names the client to the backend, a CRL refuses a revoked
server certificate, and a credentialName Secret's client certificate reaches a server that requires
one. The sidecar talks to istiod's TLS xDS port with a certificate from istiod's CA, as the agent
does (credentials go only to a verified proxy). The pod (web-1) and every backend live in one
network namespace; config: tests/data/envoy-cluster-policy.yaml."""

from __future__ import annotations

import base64
import json
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from istiod.ca.pki import cert_pem, key_pem, load_certs, load_key, new_key
from tests.conftest import DATA, render
from tests.envoy_peer import Envoy, Relay, SdsServer, bootstrap, node_id
from tests.peers import Istiod, Process, wait_until
from tests.pki import NOW, ca_cert, leaf_cert
from tests.pods import wait_serving
from tests.test_envoy_sidecar import _acked, _dynamic, captured_pod

VIPS = {"hashed": "10.96.0.22", "maglev": "10.96.0.23", "sticky": "10.96.0.24", "proxied": "10.96.0.25"}
CLUSTERS = [f"outbound|80||{name}.shop.svc.cluster.local" for name in VIPS] + [
    "outbound|80||revoked.example.com", "outbound|80||valid.example.com", "outbound|80||mutual.example.com"]
CLIENT_ID = "spiffe://example.com/client-cred"


@dataclass
class Pod:
    envoy: Envoy
    run: Any

    def curl(self, *args: str, host: str, url: str) -> str:
        done = self.run("curl", "-s", "--max-time", "10", "-H", f"Host: {host}", *args, url)
        assert done.returncode == 0, done.stderr
        return str(done.stdout)

    def stats(self, contains: str) -> int:
        lines = self.envoy.get("/stats")[1].splitlines()
        return sum(int(v) for n, _, v in (line.partition(": ") for line in lines) if contains in n and v.isdigit())


def _certificates(directory: Path) -> dict[str, Path]:
    """A CA, server certificates for revoked.example.com and valid.example.com, and the CA's CRL
    revoking the first."""
    ca_key = new_key()
    ca = ca_cert("crl test CA", ca_key)
    files: dict[str, Path] = {}

    def write(name: str, data: bytes) -> None:
        files[name] = directory / f"{name}.pem"
        files[name].write_bytes(data)

    write("ca", cert_pem(ca).encode())
    serials = {}
    for name in ("revoked", "valid"):
        key = new_key()
        cert = leaf_cert(key, (ca, ca_key), dns=(f"{name}.example.com",))
        serials[name] = cert.serial_number
        write(f"{name}_cert", cert_pem(cert).encode())
        write(f"{name}_key", key_pem(key))
    revoked = (x509.RevokedCertificateBuilder().serial_number(serials["revoked"])
               .revocation_date(NOW - timedelta(minutes=1)).build())
    crl = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject).last_update(NOW - timedelta(minutes=1))
           .next_update(NOW + timedelta(days=1)).add_revoked_certificate(revoked).sign(ca_key, hashes.SHA256()))
    write("crl", crl.public_bytes(serialization.Encoding.PEM))
    # The mutual server: a certificate of the same CA, and the client certificate (with its own CA) it requires.
    key = new_key()
    write("mutual_cert", cert_pem(leaf_cert(key, (ca, ca_key), dns=("mutual.example.com",))).encode())
    write("mutual_key", key_pem(key))
    client_ca_key, client_key = new_key(), new_key()
    client_ca = ca_cert("client CA", client_ca_key)
    write("client_ca", cert_pem(client_ca).encode())
    write("client_cert", cert_pem(leaf_cert(client_key, (client_ca, client_ca_key), uris=(CLIENT_ID,))).encode())
    write("client_key", key_pem(client_key))
    return files


def _credential_secret(certs: dict[str, Path]) -> str:
    """The Secret credentialName names: the client certificate and key, and the servers' CA."""
    data = {name: base64.b64encode(certs[file].read_bytes()).decode()
            for name, file in (("tls.crt", "client_cert"), ("tls.key", "client_key"), ("ca.crt", "ca"))}
    return json.dumps({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                       "metadata": {"name": "client-cred", "namespace": "shop"}, "data": data})


@contextmanager
def secure_sidecar(istiod: Istiod, pod: str, namespace: str, ip: str, service_account: str,
                   labels: dict[str, str]) -> Iterator[Envoy]:
    """An Envoy sidecar in its own network namespace on istiod's TLS xDS port (through a Unix
    socket relay), with a workload certificate of istiod's CA, as pilot-agent's xDS proxy connects."""
    sockets = Path(tempfile.mkdtemp(prefix="envoy-", dir="/tmp"))  # Unix socket paths must stay short
    stoppable: list[Relay | SdsServer | Envoy] = []
    try:
        ca_dir = istiod.state_dir / "istio-ca-secret"
        ca = load_certs((ca_dir / "ca-cert.pem").read_bytes(), "ca-cert.pem")[0]
        ca_key = load_key((ca_dir / "ca-key.pem").read_bytes(), "ca-key.pem")
        identity = f"spiffe://cluster.local/ns/{namespace}/sa/{service_account}"
        key = new_key()
        (sockets / "cert.pem").write_text(cert_pem(leaf_cert(key, (ca, ca_key), uris=(identity,))))
        (sockets / "key.pem").write_bytes(key_pem(key))
        stoppable.append(Relay(sockets / "xds", istiod.secure_address))
        stoppable.append(SdsServer(sockets / "sds", identity))
        config = bootstrap(node_id(pod, namespace, ip), sockets / "xds", sockets / "sds", sockets / "admin",
                           {"SERVICE_ACCOUNT": service_account, "LABELS": labels})
        config["static_resources"]["clusters"][0]["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {
                    "alpn_protocols": ["h2"],
                    "tls_certificates": [{"certificate_chain": {"filename": str(sockets / "cert.pem")},
                                          "private_key": {"filename": str(sockets / "key.pem")}}],
                    "validation_context": {"trusted_ca": {"filename": str(istiod.root_cert)}}}}}
        envoy = Envoy(config, sockets, name=f"envoy-{pod}")
        stoppable.append(envoy)
        yield envoy
    finally:
        for item in reversed(stoppable):
            item.stop()
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (Debian's package) for the capture rules")
    workdir = tmp_path_factory.mktemp("envoy-cluster-policy")
    config = workdir / "mesh"
    config.mkdir()
    shutil.copy(DATA / "sidecar-mesh.yaml", config / "sidecar-mesh.yaml")
    certs = _certificates(workdir)
    (config / "policy.yaml").write_text(render("envoy-cluster-policy.yaml", **certs))
    (config / "secret.yaml").write_text(_credential_secret(certs))
    istiod = Istiod(workdir, "--config-dir", str(config), "--poll-interval", "100ms")
    try:
        with secure_sidecar(istiod, "web-1", "shop", "127.0.0.31", "web", {"app": "web"}) as envoy, \
                captured_pod(istiod, envoy) as run:
            for vip in VIPS.values():
                assert run("ip", "addr", "add", f"{vip}/32", "dev", "lo").returncode == 0
            demo = [sys.executable, "-m", "istiod.demo.apps", "http-server", "--address"]
            backends = [
                Process(envoy.netns(*demo, "127.0.0.41:8080", "--name", "echo-1"), name="echo-1"),
                Process(envoy.netns(*demo, "127.0.0.42:8080", "--name", "echo-2"), name="echo-2"),
                Process(envoy.netns(sys.executable, "tests/proxy_protocol_echo.py", "127.0.0.45", "8080"),
                        name="proxied"),
                *(Process(envoy.netns(*demo, address, "--name", name, "--cert", str(certs[f"{name}_cert"]),
                                      "--key", str(certs[f"{name}_key"])), name=name)
                  for name, address in (("revoked", "127.0.0.46:8443"), ("valid", "127.0.0.47:8443"))),
                Process(envoy.netns(*demo, "127.0.0.48:8443", "--name", "mutual", "--cert", str(certs["mutual_cert"]),
                                    "--key", str(certs["mutual_key"]), "--client-ca", str(certs["client_ca"])),
                        name="mutual")]
            try:
                for backend in backends:
                    wait_serving(backend)
                wait_until(lambda: set(CLUSTERS) <= set(_dynamic(envoy.config_dump(), "clusters")), 20,
                           "the DestinationRules' clusters in Envoy")
                _acked(istiod, envoy)
                yield Pod(envoy, run)
            finally:
                for backend in backends:
                    backend.stop()
    finally:
        istiod.stop()


def _names(pod: Pod, service: str, *args: str, n: int = 20) -> list[str]:
    out = pod.curl("-w", "\n", *args, host=service, url=f"http://{VIPS[service]}/k/[1-{n}]")
    return [json.loads(line)["name"] for line in out.splitlines()]


@pytest.mark.parametrize("service", ["hashed", "maglev"])
def test_consistent_hash_keeps_a_header_on_one_backend(pod: Pod, service: str) -> None:
    """20 calls per x-user value all reach one backend; 16 values spread over both."""
    by_user = {user: Counter(_names(pod, service, "-H", f"x-user: user-{user}")) for user in range(16)}
    print(f"{service}: backends per x-user value: { {u: dict(c) for u, c in by_user.items()} }")
    assert all(len(seen) == 1 and sum(seen.values()) == 20 for seen in by_user.values()), by_user
    assert {name for seen in by_user.values() for name in seen} == {"echo-1", "echo-2"}
    cluster = _dynamic(pod.envoy.config_dump(), "clusters")[f"outbound|80||{service}.shop.svc.cluster.local"]
    assert cluster["lb_policy"] == ("RING_HASH" if service == "hashed" else "MAGLEV")


def test_cookie_policy_has_envoy_set_the_cookie_with_its_attributes(pod: Pod) -> None:
    head = pod.curl("-s", "-o", "/dev/null", "-D", "-", host="sticky", url=f"http://{VIPS['sticky']}/first")
    cookies = [line.split(":", 1)[1].strip() for line in head.splitlines() if line.lower().startswith("set-cookie:")]
    print(f"sticky: Envoy set {cookies}")
    assert len(cookies) == 1 and cookies[0].startswith("session=")
    parts = [p.strip() for p in cookies[0].split(";")]
    assert {"Max-Age=60", "Path=/", "HttpOnly", "SameSite=Strict", "Secure"} <= set(parts), parts
    value = parts[0]
    with_cookie = Counter(_names(pod, "sticky", "-H", f"Cookie: {value}"))
    print(f"sticky: 20 calls with {value}: {dict(with_cookie)}")
    assert len(with_cookie) == 1


def test_proxy_protocol_names_the_client_to_the_backend(pod: Pod) -> None:
    out = pod.curl("-w", "\n%{local_ip} %{local_port}", host="proxied", url=f"http://{VIPS['proxied']}/who")
    body, _, client = out.rpartition("\n")
    seen = json.loads(body)
    ip, port = client.split()
    print(f"proxied: curl from {ip}:{port}; the backend read {seen['proxy']!r} then {seen['request']!r}")
    assert seen["proxy"] == f"PROXY TCP4 {ip} {VIPS['proxied']} {port} 80"
    assert seen["request"] == "GET /who HTTP/1.1"


def test_a_revoked_server_certificate_is_refused(pod: Pod) -> None:
    valid = json.loads(pod.curl(host="valid.example.com", url=f"http://{VIPS['hashed']}/tls"))
    assert valid["name"] == "valid" and valid["tls"]["sni"] == "valid.example.com"
    before = pod.stats("outbound|80||revoked.example.com.ssl.fail_verify_error")
    refused = pod.curl("-w", " %{http_code}", host="revoked.example.com", url=f"http://{VIPS['hashed']}/tls")
    after = pod.stats("outbound|80||revoked.example.com.ssl.fail_verify_error")
    print(f"valid.example.com answered through the CRL; revoked.example.com: curl printed {refused[-60:]!r}, "
          f"fail_verify_error {before} -> {after}")
    assert refused.endswith(" 503") and after > before


def test_credential_name_client_certificate_reaches_a_server_that_requires_it(pod: Pod) -> None:
    """DestinationRule MUTUAL with credentialName: Envoy gets the Secret's client certificate and
    CA from istiod over SDS (`kubernetes://client-cred`, `kubernetes://client-cred-cacert`)."""
    seen = json.loads(pod.curl(host="mutual.example.com", url=f"http://{VIPS['hashed']}/mutual"))
    dump = pod.envoy.config_dump().get("SecretsConfigDump", {})
    secrets = [secret["name"] for secret in dump.get("dynamic_active_secrets", [])]
    print(f"mutual.example.com, credentialName client-cred: the server saw {seen['tls']}; Envoy's secrets {secrets}")
    assert seen["name"] == "mutual" and seen["tls"]["client"] == [CLIENT_ID]
    assert {"kubernetes://client-cred", "kubernetes://client-cred-cacert"} <= set(secrets)

"""A Sidecar resource's ingress listeners on a real Envoy sidecar (web-1 of tests/test_envoy_authn.py,
in its own network namespace with capture): a captured port reaches the app at defaultEndpoint on
another port; a port with `tls` SIMPLE is served with the given certificate, one with MUTUAL only to
clients with a certificate of the given CA (PeerAuthentication disables mesh mTLS there, as istiod
requires); a captureMode NONE port is a listener Envoy binds;
bad ingress listeners are refused with istiod's messages and the last good config stays."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from istiod.ca.pki import cert_pem, key_pem, new_key
from tests.peers import Istiod, wait_until
from tests.pki import ca_cert, leaf_cert
from tests.test_envoy_authn import TCP_CLIENT, TCP_ECHO, _pod, _skip_without_iptables
from tests.test_envoy_sidecar import _dynamic, _mesh

HTTP_APP = (Path(__file__).parent / "http_echo.py").read_text()
SIDECAR = """apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {{name: web, namespace: shop}}
spec:
  ingress:
  - port: {{number: 9080, protocol: HTTP, name: http}}
    defaultEndpoint: 127.0.0.1:7070
  - port: {{number: 9443, protocol: HTTPS, name: https}}
    defaultEndpoint: 127.0.0.1:7070
    tls: {{mode: SIMPLE, serverCertificate: {certs}/web.pem, privateKey: {certs}/web.key}}
  - port: {{number: 9444, protocol: HTTPS, name: https-mutual}}
    defaultEndpoint: 127.0.0.1:7070
    tls: {{mode: MUTUAL, serverCertificate: {certs}/web.pem, privateKey: {certs}/web.key, caCertificates: {certs}/ca.pem}}
  - port: {{number: 9090, protocol: TCP, name: tcp}}
    bind: 127.0.0.1
    captureMode: NONE
    defaultEndpoint: 127.0.0.1:9000
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {{name: web, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: web}}}}
  portLevelMtls: {{"9443": {{mode: DISABLE}}, "9444": {{mode: DISABLE}}}}
"""
# A TLS client that trusts only the test CA and checks the name: who answered, and with what certificate.
TLS_CLIENT = """
import json, socket, ssl, sys
context = ssl.create_default_context(cafile=sys.argv[3])
if len(sys.argv) > 4:  # a client certificate and key
    context.load_cert_chain(sys.argv[4], sys.argv[5])
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="web.shop.test") as tls:
            tls.sendall(b"GET /tls HTTP/1.1\\r\\nhost: web.shop.test\\r\\nconnection: close\\r\\n\\r\\n")
            reply = b""
            while chunk := tls.recv(4096):
                reply += chunk
            san = tls.getpeercert()["subjectAltName"]
    print(json.dumps({"san": san, "status": reply.split(b" ")[1].decode(),
                      "body": json.loads(reply.split(b"\\r\\n\\r\\n", 1)[1])}))
except (OSError, ValueError) as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
"""


def _certificates(directory: Path) -> None:
    ca_key, key = new_key(), new_key()
    ca = ca_cert("ingress test CA", ca_key)
    (directory / "ca.pem").write_text(cert_pem(ca))
    (directory / "web.pem").write_text(cert_pem(leaf_cert(key, (ca, ca_key), dns=("web.shop.test",))))
    (directory / "web.key").write_bytes(key_pem(key))
    client_key = new_key()
    (directory / "client.pem").write_text(cert_pem(leaf_cert(client_key, (ca, ca_key), dns=("client.test",))))
    (directory / "client.key").write_bytes(key_pem(client_key))


def test_ingress_listeners_on_a_real_sidecar(mesh_dir: Path, start_istiod: Callable[..., Istiod],
                                             tmp_path: Path) -> None:
    _skip_without_iptables()
    _mesh(mesh_dir)
    _certificates(tmp_path)
    good = SIDECAR.format(certs=tmp_path)
    (mesh_dir / "sidecar.yaml").write_text(good)
    istiod = start_istiod(mesh_dir)
    with _pod(istiod, (HTTP_APP, "127.0.0.1", "7070", "ingress-app"), (TCP_ECHO, "127.0.0.1", "9000")) as (envoy, run):
        for port in ("9080", "9443", "9444"):  # inbound to the ingress ports captured (istio-init's rules for them)
            assert run("iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", "127.0.0.31", "--dport", port,
                       "-j", "REDIRECT", "--to-ports", "15006").returncode == 0

        def http(url: str) -> dict[str, object]:
            done = run("curl", "-s", "--max-time", "5", url)
            try:
                return dict(json.loads(done.stdout))
            except ValueError:
                return {"error": f"exit {done.returncode}: {done.stdout!r}"}

        def tls(port: str = "9443", *client: str) -> dict[str, object]:
            done = run(sys.executable, "-c", TLS_CLIENT, "127.0.0.31", port, str(tmp_path / "ca.pem"),
                       *(str(tmp_path / name) for name in client))
            return dict(json.loads(done.stdout.strip().splitlines()[-1]))

        def tcp() -> str:
            return run(sys.executable, "-c", TCP_CLIENT, "127.0.0.1", "9090").stdout.strip()

        # 9080 through virtualInbound to the app on 127.0.0.1:7070 (nothing listens on 9080 itself).
        wait_until(lambda: http("http://127.0.0.31:9080/plain").get("name") == "ingress-app", 10,
                   "the app at defaultEndpoint through 9080")
        print(f"9080: {http('http://127.0.0.31:9080/plain')}")
        # 9443: the sidecar terminates TLS with the Sidecar's certificate, then the same app.
        wait_until(lambda: tls().get("status") == "200", 10, "TLS on 9443")
        answer = tls()
        print(f"9443: {answer}")
        assert answer["san"] == [["DNS", "web.shop.test"]]
        assert isinstance(answer["body"], dict) and answer["body"]["name"] == "ingress-app"
        # 9444 (MUTUAL): only a client with a certificate the given CA signed is served.
        answer = tls("9444", "client.pem", "client.key")
        print(f"9444 with a client certificate: {answer}")
        assert answer.get("status") == "200" and isinstance(answer["body"], dict)
        assert "client.test" in str(answer["body"]["xfcc"])  # the app sees who called
        refused = tls("9444")
        print(f"9444 without: {refused}")
        assert "error" in refused
        # 9090: Envoy's own listener on 127.0.0.1 (captureMode NONE), to the echo on 9000.
        wait_until(lambda: tcp() == "b'ping\\n'", 10, "the echo through Envoy's bound 9090")
        listeners = _dynamic(envoy.config_dump(), "listeners")
        assert "127.0.0.1_9090" in listeners
        assert {c["name"] for c in listeners["virtualInbound"]["filter_chains"]} >= {
            "0.0.0.0_9080", "0.0.0.0_9443", "0.0.0.0_9444"}
        assert "0.0.0.0_8080" not in {c["name"] for c in listeners["virtualInbound"]["filter_chains"]}

        # Bad ingress listeners: refused with istiod's messages, naming the object and field; the
        # last good Sidecar keeps serving.
        for bad, message in (
                (good.replace("defaultEndpoint: 127.0.0.1:9000", "defaultEndpoint: 10.0.0.1:9000"),
                 "Sidecar shop/web: spec.ingress[3].defaultEndpoint: sidecar: defaultEndpoint must be of form "
                 "127.0.0.1:<port>,0.0.0.0:<port>,[::1]:port,[::]:port,unix://filepath or unset"),
                (good.replace("number: 9090", "number: 9080"),
                 "Sidecar shop/web: spec.ingress[3].port: sidecar: ports on IP bound listeners must be unique"),
                (good.replace("defaultEndpoint: 127.0.0.1:9000", "defaultEndpoint: unix:///var/run/app.sock"),
                 "spec.ingress[3].defaultEndpoint: unix domain socket endpoints are not supported by this istiod")):
            (mesh_dir / "sidecar.yaml").write_text(bad)
            wait_until(lambda: message in istiod.text(), 10, f"istiod to refuse: {message}")
            print(f"refused: {message}")
            assert http("http://127.0.0.31:9080/plain").get("name") == "ingress-app"
            assert tcp() == "b'ping\\n'"

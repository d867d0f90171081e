"""An HTTPS app for passthrough tests: answers every GET with its name and the path, over TLS with
the certificate and key files it is given (so a client can tell it reached this app unopened).
Arguments: ip port cert.pem key.pem name [ca.pem: then a client certificate of that CA is required,
and its URI SANs are answered as `peer`, as a sidecar's inbound mTLS would see the caller]."""

import http.server
import json
import ssl
import sys


class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        reply = {"name": sys.argv[5], "path": self.path}
        if len(sys.argv) > 6:
            certificate = self.connection.getpeercert() or {}  # type: ignore[attr-defined]
            reply["peer"] = ",".join(v for k, v in certificate.get("subjectAltName", ()) if k == "URI")
        body = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


server = http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Echo)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[3], sys.argv[4])
if len(sys.argv) > 6:
    context.load_verify_locations(sys.argv[6])
    context.verify_mode = ssl.CERT_REQUIRED
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()

"""An HTTPS app for passthrough tests: answers every GET with its name and the path, over TLS with
the certificate and key files it is given (so a client can tell it reached this app unopened).
Arguments: ip port cert.pem key.pem name."""

import http.server
import json
import ssl
import sys


class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"name": sys.argv[5], "path": self.path}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


server = http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Echo)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[3], sys.argv[4])
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()

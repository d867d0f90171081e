"""An HTTP app for sidecar tests: answers every GET with the Host and x-forwarded-client-cert it saw."""

import http.server
import json
import sys


class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"host": self.headers.get("host"), "xfcc": self.headers.get("x-forwarded-client-cert")}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Echo).serve_forever()

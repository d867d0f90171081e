"""An HTTP app for sidecar tests: answers every GET with the Host, x-forwarded-client-cert, path and
headers it saw, and its own name (the optional third argument); while the file named by the
optional fourth argument exists, it answers 503 instead (a failing backend)."""

import http.server
import json
import os
import sys


class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"host": self.headers.get("host"), "xfcc": self.headers.get("x-forwarded-client-cert"),
                           "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                           "name": sys.argv[3] if len(sys.argv) > 3 else ""}).encode()
        failing = len(sys.argv) > 4 and os.path.exists(sys.argv[4])
        self.send_response(503 if failing else 200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Echo).serve_forever()

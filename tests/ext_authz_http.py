"""An HTTP external authorizer for ext_authz tests: allows a request whose `x-ext-authz` header is
`allow`, or whose body (when the proxy sends it) is `let me in` (200, with `x-ext-authz-check-result:
allowed` for the upstream), denies the rest (403)."""

import http.server
import sys


class Check(http.server.BaseHTTPRequestHandler):
    def _check(self) -> None:
        sent = self.rfile.read(int(self.headers.get("content-length") or 0))
        allowed = self.headers.get("x-ext-authz") == "allow" or sent == b"let me in"
        body = b"" if allowed else b"denied by ext_authz"
        self.send_response(200 if allowed else 403)
        self.send_header("x-ext-authz-check-result", "allowed" if allowed else "denied")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _check

    def log_message(self, *args: object) -> None:
        pass


http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Check).serve_forever()

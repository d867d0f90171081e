"""A backend behind a PROXY protocol (v1) header: answers each HTTP request with the header line
the connection began with, so a test sees whom the proxy named as the client. Prints
{"serving": ...} once listening. Arguments: address, port."""

import json
import socketserver
import sys


class Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        proxy = self.rfile.readline(108).decode("ascii", "replace").rstrip("\r\n")  # v1's longest header
        while True:
            request = self.rfile.readline()
            if not request:
                return
            length = 0
            while (line := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            self.rfile.read(length)
            body = json.dumps({"proxy": proxy, "request": request.decode("latin-1").strip()}).encode()
            self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


with Server((sys.argv[1], int(sys.argv[2])), Handler) as server:
    print(json.dumps({"serving": f"{sys.argv[1]}:{sys.argv[2]}"}), flush=True)
    server.serve_forever()

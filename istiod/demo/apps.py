"""The apps inside demo and test pods: an HTTP server that reports what it received (headers too,
so x-forwarded-client-cert shows), a TCP echo, and one-shot clients that print one JSON line.
`python -m istiod.demo.apps <command> ...`"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import StreamRequestHandler, ThreadingTCPServer
from typing import Any, cast

from istiod.model.names import split_host_port


def _print(value: dict[str, Any]) -> None:
    print(json.dumps(value), flush=True)


def http_server(args: argparse.Namespace) -> None:
    name = args.name

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Without it keep-alive requests through Envoy stall 40 ms each (Nagle + delayed ACK).
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_GET(self) -> None:
            reply: dict[str, Any] = {"name": name, "path": self.path, "peer": self.client_address[0],
                                     "headers": {k.lower(): v for k, v in self.headers.items()}}
            if isinstance(self.connection, ssl.SSLSocket):
                peer = self.connection.getpeercert()
                sans = cast("tuple[tuple[str, str], ...]", peer.get("subjectAltName", ())) if peer else None
                reply["tls"] = {"version": self.connection.version(), "sni": getattr(self.connection, "sni", None),
                                "client": None if sans is None else [value for _, value in sans]}
            body = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *values: Any) -> None:
            _print({"request": format % values, "from": self.client_address[0]})

    host, port = split_host_port(args.address)
    server = ThreadingHTTPServer((host, port), Handler)
    if args.cert:
        server.socket = _tls_context(args).wrap_socket(server.socket, server_side=True)
    _serve(server, args.address, name)


def _tls_context(args: argparse.Namespace) -> ssl.SSLContext:
    """HTTPS with `--cert`/`--key`; `--client-ca`: a client certificate it signed is required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(args.cert, args.key)
    if args.client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(args.client_ca)

    def remember_sni(connection: Any, server_name: str | None, _: ssl.SSLContext) -> None:
        connection.sni = server_name  # what the client asked for, shown in each reply

    context.sni_callback = remember_sni
    return context


def tcp_echo(args: argparse.Namespace) -> None:
    prefix = f"{args.name}: ".encode()

    class Handler(StreamRequestHandler):
        def handle(self) -> None:
            for line in self.rfile:
                self.wfile.write(prefix + line)

    host, port = split_host_port(args.address)
    ThreadingTCPServer.allow_reuse_address = True
    ThreadingTCPServer.daemon_threads = True
    _serve(ThreadingTCPServer((host, port), Handler), args.address, args.name)


def _serve(server: Any, address: str, name: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _print({"serving": address, "name": name})
    server.serve_forever()


def http_get(args: argparse.Namespace) -> None:
    """One GET, or `--count` of them (0: until stopped) every `--interval` seconds, a JSON line each."""
    request = urllib.request.Request(args.url, headers=dict(h.split(": ", 1) for h in args.header))
    # Never a proxy from the environment: the call must go where the pod's capture sends it.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    sent = 0
    while args.count == 0 or sent < args.count:
        if sent:
            time.sleep(args.interval)
        sent += 1
        _print(_get(opener, request, args.timeout))


def _get(opener: urllib.request.OpenerDirector, request: urllib.request.Request, timeout: float) -> dict[str, Any]:
    try:
        with opener.open(request, timeout=timeout) as reply:
            body = reply.read().decode()
            status = reply.status
            headers = dict(reply.headers.items())
    except urllib.error.HTTPError as error:
        body, status, headers = error.read().decode(), error.code, dict(error.headers.items())
    except OSError as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    try:
        parsed: Any = json.loads(body)
    except json.JSONDecodeError:
        parsed = body
    return {"ok": status == 200, "status": status, "body": parsed, "headers": {k.lower(): v for k, v in headers.items()}}


def tcp_call(args: argparse.Namespace) -> None:
    host, port = split_host_port(args.address)
    try:
        with socket.create_connection((host, port), timeout=args.timeout) as sock:
            sock.sendall(args.message.encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError as error:
        _print({"ok": False, "error": f"{type(error).__name__}: {error}"})
        return
    _print({"ok": reply.endswith(b"\n"), "reply": reply.decode().rstrip("\n")})


def grpc_call(args: argparse.Namespace) -> None:
    # The pod's /etc/hosts names the Service's VIP; gRPC's own resolver would not read it.
    os.environ.setdefault("GRPC_DNS_RESOLVER", "native")
    import grpc

    from istiod.demo.__main__ import METHOD

    with grpc.insecure_channel(args.target) as channel:
        try:
            echo: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(METHOD)
            reply = echo(b"hello", timeout=args.timeout)
        except grpc.RpcError as error:
            _print({"ok": False, "code": error.code().name, "error": error.details()})
            return
    _print({"ok": True, "reply": reply.decode()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m istiod.demo.apps")
    commands = parser.add_subparsers(dest="command", required=True)
    for command, function in (("http-server", http_server), ("tcp-echo", tcp_echo)):
        server = commands.add_parser(command)
        server.add_argument("--address", required=True)
        server.add_argument("--name", required=True)
        server.set_defaults(function=function)
        if command == "http-server":
            server.add_argument("--cert", help="PEM certificate chain: serve HTTPS")
            server.add_argument("--key", help="PEM private key for --cert")
            server.add_argument("--client-ca", help="PEM CA bundle: require a client certificate it signed")
    get = commands.add_parser("http-get")
    get.add_argument("url")
    get.add_argument("--header", action="append", default=[], help="'name: value'")
    get.add_argument("--count", type=int, default=1, help="calls to make; 0 = until stopped")
    get.add_argument("--interval", type=float, default=0.1)
    get.set_defaults(function=http_get)
    tcp = commands.add_parser("tcp-call")
    tcp.add_argument("address")
    tcp.add_argument("message")
    tcp.set_defaults(function=tcp_call)
    rpc = commands.add_parser("grpc-call")
    rpc.add_argument("target", help="e.g. dns:///echo.ns.svc.cluster.local:7070")
    rpc.set_defaults(function=grpc_call)
    for client in (get, tcp, rpc):
        client.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    args.function(args)


if __name__ == "__main__":
    main()

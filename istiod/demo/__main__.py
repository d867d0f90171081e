"""`python -m istiod.demo server|client`.

server: answers /demo.Echo/Echo with its name and address; `--xds` makes it an xDS-enabled server
        that waits for its inbound listener from istiod.
client: calls a target (`xds:///host:port`) repeatedly and prints one JSON line per call;
        `--mtls` uses xDS channel credentials (TLS when istiod's cluster says so).
Both take their xDS bootstrap from GRPC_XDS_BOOTSTRAP (a file, as `istiod agent` writes it) or
GRPC_XDS_BOOTSTRAP_CONFIG, or build a plaintext one from --xds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from concurrent import futures

from istiod.agent.bootstrap import NodeInfo, bootstrap_json
from istiod.model.names import split_host_port

METHOD = "/demo.Echo/Echo"


def _ensure_bootstrap(args: argparse.Namespace, ip: str, pod: str) -> None:
    """gRPC reads the bootstrap once per process, so it must be in the environment before use."""
    if args.xds and not {"GRPC_XDS_BOOTSTRAP", "GRPC_XDS_BOOTSTRAP_CONFIG"} & os.environ.keys():
        node = NodeInfo(ip=ip, pod=pod, namespace=args.namespace)
        os.environ["GRPC_XDS_BOOTSTRAP_CONFIG"] = bootstrap_json(args.xds, node)


def serve(args: argparse.Namespace) -> int:
    import grpc

    host, _ = split_host_port(args.address, allow_zero_port=True)
    _ensure_bootstrap(args, host, args.name)
    reply = f"{args.name} {args.address}".encode()
    served = iter(range(1, 2**63))
    lock = threading.Lock()

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        with lock:
            count = next(served)
        if args.fail_every and count % args.fail_every == 0:
            context.abort(grpc.StatusCode[args.fail_code], f"{args.name}: call {count} fails on purpose")
        peer: list[bytes] = dict(context.auth_context()).get("x509_subject_alternative_name", [b""])  # type: ignore[assignment]  # grpcio gives lists, its stubs say bytes
        return reply + (b" peer=" + b",".join(peer) if any(peer) else b"")

    handler = grpc.method_handlers_generic_handler("demo.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    if args.xds:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), xds=True)
        server.add_generic_rpc_handlers((handler,))
        server.add_secure_port(args.address, grpc.xds_server_credentials(grpc.insecure_server_credentials()))
    else:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(args.address)
    server.start()
    print(json.dumps({"serving": args.address, "name": args.name, "xds": bool(args.xds)}), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=0.5).wait()
    return 0


def call(args: argparse.Namespace) -> int:
    import grpc

    _ensure_bootstrap(args, args.node_ip, "demo-client")
    if args.mtls:
        from grpc.experimental import insecure_channel_credentials

        channel = grpc.secure_channel(args.target, grpc.xds_channel_credentials(insecure_channel_credentials()))
    else:
        channel = grpc.insecure_channel(args.target)
    echo: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(METHOD)
    metadata = tuple((name, value) for name, _, value in (h.partition("=") for h in args.header))
    failures = 0
    sent = 0
    while args.count == 0 or sent < args.count:
        sent += 1
        started = time.monotonic()
        try:
            reply = echo(b"hello", timeout=args.timeout, metadata=metadata).decode()
            result = {"ok": True, "reply": reply}
        except grpc.RpcError as error:
            failures += 1
            result = {"ok": False, "code": error.code().name, "error": error.details()}
        result["ms"] = round((time.monotonic() - started) * 1000, 1)
        print(json.dumps(result), flush=True)
        time.sleep(args.interval)
    channel.close()
    return 1 if failures == sent else 0


def _listen_address(text: str) -> str:
    try:
        split_host_port(text, allow_zero_port=True)
    except ValueError:
        raise argparse.ArgumentTypeError(f"address {text!r} must be ip:port or [ipv6]:port") from None
    return text


def _header(text: str) -> str:
    name, eq, _ = text.partition("=")
    if not eq or not name or name != name.lower():
        raise argparse.ArgumentTypeError(f"header {text!r} must be name=value, the name in lower case")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m istiod.demo")
    commands = parser.add_subparsers(dest="command", required=True)
    server = commands.add_parser("server", help="run an echo backend")
    server.add_argument("--address", required=True, type=_listen_address, help="ip:port to listen on, e.g. 127.0.0.10:7070")
    server.add_argument("--name", default="echo", help="the name it answers with (its pod name)")
    server.add_argument("--xds", help="istiod's xDS address: serve as an xDS-enabled gRPC server")
    server.add_argument("--namespace", default="demo")
    server.add_argument("--fail-every", type=int, default=0, metavar="N", help="fail every Nth call (retry tests)")
    server.add_argument("--fail-code", default="UNAVAILABLE", choices=("UNAVAILABLE", "RESOURCE_EXHAUSTED", "INTERNAL"),
                        help="the status those calls fail with")
    client = commands.add_parser("client", help="call a target through xDS")
    client.add_argument("target", help="e.g. xds:///echo.demo.svc.cluster.local:7070")
    client.add_argument("--xds", help="istiod's xDS address, e.g. 127.0.0.1:15010")
    client.add_argument("--namespace", default="demo")
    client.add_argument("--node-ip", default="127.0.0.1")
    client.add_argument("--mtls", action="store_true", help="xDS channel credentials, falling back to plaintext")
    client.add_argument("--count", type=int, default=5, help="calls to make; 0 = until stopped")
    client.add_argument("--interval", type=float, default=0.2)
    client.add_argument("--timeout", type=float, default=2.0)
    client.add_argument("--header", action="append", default=[], type=_header,
                        help="NAME=VALUE metadata on every call (repeatable)")
    args = parser.parse_args(argv)
    return serve(args) if args.command == "server" else call(args)


if __name__ == "__main__":
    sys.exit(main())

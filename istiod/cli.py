"""`istiod <command>`: argument parsing and dispatch, nothing else."""

from __future__ import annotations

import argparse
import asyncio
import sys

from istiod import __version__, logs
from istiod.agent.settings import add_agent_flags, agent_settings_from_args
from istiod.operator.cli import add_install_flags, add_manifest_flags, run_manifest
from istiod.settings import add_discovery_flags, settings_from_args

DEFAULT_ISTIOD_URL = "http://localhost:15014"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="istiod", description="An istiod-compatible control plane.")
    parser.add_argument("--version", action="version", version=f"istiod {__version__}")
    parser.add_argument("--log-level", default="info", choices=logs.LEVELS)
    parser.add_argument("--log-format", default="kv", choices=logs.FORMATS,
                        help="one line per event as key=value pairs (kv) or as a JSON object")
    commands = parser.add_subparsers(dest="command", required=True)
    discovery = commands.add_parser("discovery", help="serve xDS from a config dir or a cluster")
    add_discovery_flags(discovery)
    agent = commands.add_parser("agent", help="get workload certificates from istiod's CA and write the gRPC bootstrap")
    add_agent_flags(agent)

    status = commands.add_parser("proxy-status", help="each connected proxy's sync state, or one proxy's diff")
    status.add_argument("proxy", nargs="?", help="a proxy ID or <pod>.<namespace>: show what it has not ACKed")
    config = commands.add_parser("proxy-config", help="the clusters, listeners, routes or endpoints a proxy was sent")
    config.add_argument("kind", choices=("clusters", "listeners", "routes", "endpoints"))
    config.add_argument("proxy", help="a proxy ID or <pod>.<namespace>")
    config.add_argument("-o", "--output", choices=("short", "json"), default="short")
    for tool in (status, config):
        tool.add_argument("--istiod", default=DEFAULT_ISTIOD_URL,
                          help=f"istiod's debug URL (default {DEFAULT_ISTIOD_URL})")

    manifest = commands.add_parser("manifest", help="the Kubernetes manifests of an install (IstioOperator)")
    generate = manifest.add_subparsers(dest="action", required=True).add_parser(
        "generate", help="render an IstioOperator spec with the Helm charts, to stdout")
    add_manifest_flags(generate)
    add_install_flags(commands.add_parser("install", help="apply an IstioOperator spec's manifests and wait for istiod"))

    args = parser.parse_args(argv)
    logs.setup(args.log_level, args.log_format)
    if args.command == "discovery":
        from istiod.server import run_discovery

        return asyncio.run(run_discovery(settings_from_args(args)))
    if args.command == "agent":
        from istiod.agent.agent import run_agent

        return asyncio.run(run_agent(agent_settings_from_args(args)))
    if args.command in ("manifest", "install"):
        return run_manifest(args)
    from istiod.tools import proxy_config, proxy_status
    from istiod.tools.debug_client import DebugClient, ToolError

    client = DebugClient(args.istiod)
    try:
        if args.command == "proxy-status":
            return proxy_status.run(client, args.proxy)
        return proxy_config.run(client, args.kind, args.proxy, args.output)
    except ToolError as error:
        print(f"istiod {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

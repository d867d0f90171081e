"""`istiod <command>`: argument parsing and dispatch, nothing else."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from istiod import __version__
from istiod.agent.settings import add_agent_flags, agent_settings_from_args
from istiod.settings import add_discovery_flags, settings_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="istiod", description="An istiod-compatible control plane.")
    parser.add_argument("--version", action="version", version=f"istiod {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(dest="command", required=True)
    discovery = commands.add_parser("discovery", help="serve xDS from a config dir or a cluster")
    add_discovery_flags(discovery)
    agent = commands.add_parser("agent", help="get workload certificates from istiod's CA and write the gRPC bootstrap")
    add_agent_flags(agent)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    if args.command == "discovery":
        from istiod.server import run_discovery

        asyncio.run(run_discovery(settings_from_args(args)))
    elif args.command == "agent":
        from istiod.agent.agent import run_agent

        return asyncio.run(run_agent(agent_settings_from_args(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

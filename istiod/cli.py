"""`istiod <command>`: argument parsing and dispatch, nothing else."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import sys
from typing import NoReturn
from pathlib import Path

from istiod import __version__, logs
from istiod.eventloop import run_fast
from istiod.agent.iptables import add_iptables_flags
from istiod.agent.wait import add_wait_flags
from istiod.agent.settings import add_agent_flags, add_proxy_flags, agent_settings_from_args, proxy_settings_from_args
from istiod.cni.settings import add_cni_flags, cni_settings_from_args
from istiod.operator.cli import add_install_flags, add_manifest_flags, run_manifest
from istiod.operator.tag import add_tag_flags, run_tag
from istiod.settings import add_discovery_flags, settings_from_args

DEFAULT_ISTIOD_URL = "http://localhost:15014"
# istioctl's proxy-config kinds and their aliases; the first name is ours. Others (secret, bootstrap, ...)
# are refused with the list of these.
CONFIG_KINDS = {
    "clusters": ("cluster", "c"),
    "listeners": ("listener", "l"),
    "routes": ("route", "r"),
    "endpoints": ("endpoint", "ep"),
}


class _Parser(argparse.ArgumentParser):
    """A usage mistake is one line naming it (argparse would print the whole usage first), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> _Parser:
    # allow_abbrev=False: as Go's flags, `--config` is not taken for `--config-dir`.
    parser = _Parser(prog="istiod", description="An istiod-compatible control plane.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"istiod {__version__}")
    parser.add_argument("--log-level", default="info", choices=logs.LEVELS)
    parser.add_argument("--log-format", default="kv", choices=logs.FORMATS,
                        help="one line per event as key=value pairs (kv) or as a JSON object")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, aliases: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, aliases=list(aliases), allow_abbrev=False)
        sub.set_defaults(command=name, parser=sub)  # an alias (`ps`) runs its command; `parser` names unknown flags
        return sub

    add_discovery_flags(command("discovery", "serve xDS from a config dir or a cluster"))
    agent = command("agent", "get workload certificates from istiod's CA and write the gRPC bootstrap")
    add_agent_flags(agent)
    agent_modes = agent.add_subparsers(dest="agent_mode", metavar="MODE")
    proxy = agent_modes.add_parser("proxy", allow_abbrev=False, help="run an Envoy sidecar: SDS, the xDS proxy, "
                                   "the Envoy bootstrap, Envoy's supervision, status ports")
    proxy.set_defaults(parser=proxy)
    add_proxy_flags(proxy)
    iptables = agent_modes.add_parser("iptables", allow_abbrev=False,
                                      help="install istio-init's traffic capture in this network namespace")
    iptables.set_defaults(parser=iptables)
    add_iptables_flags(iptables)
    wait = agent_modes.add_parser("wait", allow_abbrev=False, help="until the proxy is ready, as pilot-agent wait "
                                  "(holdApplicationUntilProxyStarts' postStart hook)")
    wait.set_defaults(parser=wait)
    add_wait_flags(wait)
    add_cni_flags(command("cni", "the istio-cni node agent: capture this node's ambient pods for ztunnel"))
    status = command("proxy-status", "each connected proxy's sync state, or one proxy's diff", ("ps",))
    status.add_argument("proxy", nargs="?", help="a proxy ID or <pod>.<namespace>: show what it has not ACKed")
    _add_istiod_url(status)
    config = command("proxy-config", "the clusters, listeners, routes or endpoints a proxy was sent", ("pc",))
    kinds = config.add_subparsers(dest="kind", required=True, metavar="KIND")
    by_kind: dict[str, argparse.ArgumentParser] = {}
    for kind, aliases in CONFIG_KINDS.items():
        sub = by_kind[kind] = kinds.add_parser(kind, aliases=list(aliases), allow_abbrev=False,
                                               help=f"the {kind} a proxy was sent")
        sub.set_defaults(kind=kind, parser=sub)
        sub.add_argument("proxy", help="a proxy ID or <pod>.<namespace>")
        sub.add_argument("-o", "--output", choices=("short", "json", "yaml"), default="short")
        _add_istiod_url(sub)
    by_kind["clusters"].add_argument("--fqdn", help="only clusters of this service host (or a part of it)")
    by_kind["clusters"].add_argument("--port", type=int, help="only clusters of this service port")
    by_kind["clusters"].add_argument("--direction", type=str.lower, choices=("inbound", "outbound"))
    by_kind["clusters"].add_argument("--subset", help="only clusters of this subset")
    by_kind["listeners"].add_argument("--port", type=int, help="only listeners on this port")
    by_kind["routes"].add_argument("--name", help="only the route configuration of this name")
    by_kind["endpoints"].add_argument("--port", type=int, help="only endpoints on this port")
    by_kind["endpoints"].add_argument("--cluster", help="only endpoints of clusters whose name contains this")
    version = command("version", "istiod's version (with --remote, also the running istiod's)")
    version.add_argument("-s", "--short", action="store_true", help="the version number only")
    version.add_argument("--remote", action="store_true", help="also ask the istiod at --istiod")
    _add_istiod_url(version)
    analyze = commands.add_parser("analyze", help="validate Istio config and check it across objects, as istioctl analyze")
    analyze.add_argument("files", nargs="*", type=Path, metavar="FILE", help="YAML files or directories")
    analyze.add_argument("--kubeconfig", type=Path, help="analyze this cluster's objects (the files go on top)")
    analyze.add_argument("-n", "--namespace", default="default", help="report on this namespace (default: default)")
    analyze.add_argument("-A", "--all-namespaces", action="store_true", help="report on all namespaces")
    analyze.add_argument("-o", "--output", choices=("log", "json"), default="log")
    manifest = command("manifest", "the Kubernetes manifests of an install (IstioOperator)")
    generate = manifest.add_subparsers(dest="action", required=True, metavar="ACTION").add_parser(
        "generate", allow_abbrev=False, help="render an IstioOperator spec with the Helm charts, to stdout")
    generate.set_defaults(parser=generate)
    add_manifest_flags(generate)
    add_install_flags(command("install", "apply an IstioOperator spec's manifests and wait for istiod"))
    add_tag_flags(command("tag", "revision tags (istio.io/rev=<tag> namespaces injected by a revision), as istioctl tag"))
    return parser


def _add_istiod_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--istiod", default=DEFAULT_ISTIOD_URL, help=f"istiod's debug URL (default {DEFAULT_ISTIOD_URL})")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        where: argparse.ArgumentParser = getattr(args, "parser", parser)
        where.error(_unknown(where, unknown))
    return args


def _unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    flag = next((u.partition("=")[0] for u in unknown if u.startswith("-")), None)
    if flag is None:
        return f"unexpected argument {unknown[0]!r}"
    flags = [o for o in parser._option_string_actions if o.startswith("--")]
    # Our kebab-case spelling first; pilot-discovery's camelCase aliases only when nothing else is close.
    close = (difflib.get_close_matches(flag, [f for f in flags if f == f.lower()], n=1)
             or difflib.get_close_matches(flag, flags, n=1))
    return f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else "")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logs.setup(args.log_level, args.log_format)
    if args.command == "discovery":
        from istiod.server import run_discovery

        return run_fast(run_discovery(settings_from_args(args)))
    if args.command == "agent" and args.agent_mode == "iptables":
        from istiod.agent.iptables import run_iptables

        return run_iptables(args)
    if args.command == "agent" and args.agent_mode == "wait":
        from istiod.agent.wait import run_wait

        return run_wait(args)
    if args.command == "agent" and args.agent_mode == "proxy":
        from istiod.agent.proxy import run_proxy_agent

        return asyncio.run(run_proxy_agent(agent_settings_from_args(args), proxy_settings_from_args(args)))
    if args.command == "agent":
        from istiod.agent.agent import run_agent

        return asyncio.run(run_agent(agent_settings_from_args(args)))
    if args.command == "cni":
        from istiod.cni.node import run_cni

        return asyncio.run(run_cni(cni_settings_from_args(args)))
    if args.command == "analyze":
        return _analyze(args)
    if args.command in ("manifest", "install"):
        return run_manifest(args)
    if args.command == "tag":
        return run_tag(args)
    from istiod.tools import proxy_config, proxy_status, version
    from istiod.tools.debug_client import DebugClient, ToolError

    client = DebugClient(args.istiod)
    try:
        if args.command == "proxy-status":
            return proxy_status.run(client, args.proxy)
        if args.command == "version":
            return version.run(client if args.remote else None, args.short)
        return proxy_config.run(client, args.kind, args.proxy, args.output, proxy_config.Filter.from_args(args))
    except ToolError as error:
        print(f"istiod {args.command}: {error}", file=sys.stderr)
        return 1


def _analyze(args: argparse.Namespace) -> int:
    from istiod.tools import analyze

    if not args.files and args.kubeconfig is None:
        print("istiod analyze: give FILES or --kubeconfig", file=sys.stderr)
        return analyze.EXIT_USAGE
    return analyze.run(args.files, args.kubeconfig, args.output, None if args.all_namespaces else args.namespace)


if __name__ == "__main__":
    sys.exit(main())

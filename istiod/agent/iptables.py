"""`istiod agent iptables`: istio-init's traffic capture (istio-iptables, REDIRECT mode).

Renders the nat-table chains Istio's init container installs in a pod's network namespace and
applies them atomically with iptables-restore: outbound TCP goes to Envoy's 15001, inbound TCP to
15006; Envoy's own traffic (uid/gid 1337) and the inbound cluster's 127.0.0.6 source are exempt,
so Envoy never captures itself. Only what `istio-iptables` does in REDIRECT mode for IPv4 TCP:
TPROXY, IPv6 and DNS capture are refused, not silently skipped.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import subprocess
from dataclasses import dataclass

log = logging.getLogger(__name__)

CHAINS = ("ISTIO_INBOUND", "ISTIO_REDIRECT", "ISTIO_IN_REDIRECT", "ISTIO_OUTPUT")
INBOUND_TUNNEL_PORT = 15008  # HBONE; istio-init never captures it
# What Istio's injector passes as -d: the agent's and Envoy's own ports stay reachable.
DEFAULT_EXCLUDED_INBOUND_PORTS = (15090, 15021, 15020)
# The inbound cluster binds this source so that Envoy's forwarded inbound call is not captured again.
INBOUND_PASSTHROUGH_SOURCE = "127.0.0.6"
LOCALHOST = "127.0.0.1/32"


class IptablesError(Exception):
    """A bad flag or a failed iptables command, in one line."""


@dataclass(frozen=True, slots=True)
class CaptureConfig:
    """istio-iptables' flags; `*` means every port or address, as in Istio."""

    outbound_port: int = 15001  # -p
    inbound_port: int = 15006  # -z
    proxy_uid: str = "1337"  # -u (comma-separated)
    proxy_gid: str = "1337"  # -g
    include_cidrs: tuple[str, ...] = ("*",)  # -i
    exclude_cidrs: tuple[str, ...] = ()  # -x
    include_inbound_ports: tuple[str, ...] = ("*",)  # -b
    exclude_inbound_ports: tuple[int, ...] = DEFAULT_EXCLUDED_INBOUND_PORTS  # -d
    exclude_outbound_ports: tuple[int, ...] = ()  # -o


def render(config: CaptureConfig) -> str:
    """The iptables-restore input for the nat table, rule for rule as istio-iptables writes it."""
    rules = [f":{chain} - [0:0]" for chain in CHAINS]
    rules += [
        f"-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports {config.outbound_port}",
        f"-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports {config.inbound_port}",
    ]
    rules += _inbound(config)
    rules += _output(config)
    return "*nat\n" + "\n".join(rules) + "\nCOMMIT\n"


def _inbound(config: CaptureConfig) -> list[str]:
    if not config.include_inbound_ports:
        return []
    rules = ["-A PREROUTING -p tcp -j ISTIO_INBOUND"]
    if config.include_inbound_ports == ("*",):
        rules += [f"-A ISTIO_INBOUND -p tcp --dport {port} -j RETURN"
                  for port in (INBOUND_TUNNEL_PORT, *config.exclude_inbound_ports)]
        rules.append("-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT")
    else:
        rules += [f"-A ISTIO_INBOUND -p tcp --dport {port} -j ISTIO_IN_REDIRECT" for port in config.include_inbound_ports]
    return rules


def _output(config: CaptureConfig) -> list[str]:
    rules = ["-A OUTPUT -p tcp -j ISTIO_OUTPUT"]
    rules += [f"-A ISTIO_OUTPUT -p tcp --dport {port} -j RETURN" for port in config.exclude_outbound_ports]
    rules.append(f"-A ISTIO_OUTPUT -s {INBOUND_PASSTHROUGH_SOURCE}/32 -o lo -j RETURN")
    # Envoy calling its own pod's IP (over lo) is inbound traffic for its own inbound listener.
    for owner, ids in (("uid-owner", config.proxy_uid), ("gid-owner", config.proxy_gid)):
        for owner_id in ids.split(","):
            rules += [
                f"-A ISTIO_OUTPUT ! -d {LOCALHOST} -o lo -p tcp ! --dport {INBOUND_TUNNEL_PORT} "
                f"-m owner --{owner} {owner_id} -j ISTIO_IN_REDIRECT",
                f"-A ISTIO_OUTPUT -o lo -m owner ! --{owner} {owner_id} -j RETURN",
                f"-A ISTIO_OUTPUT -m owner --{owner} {owner_id} -j RETURN",
            ]
    rules.append(f"-A ISTIO_OUTPUT -d {LOCALHOST} -j RETURN")
    rules += [f"-A ISTIO_OUTPUT -d {cidr} -j RETURN" for cidr in config.exclude_cidrs]
    if config.include_cidrs == ("*",):
        rules.append("-A ISTIO_OUTPUT -j ISTIO_REDIRECT")
    else:
        rules += [f"-A ISTIO_OUTPUT -d {cidr} -j ISTIO_REDIRECT" for cidr in config.include_cidrs]
    return rules


def without_capture(saved: str) -> str:
    """`iptables-save -t nat` output with every ISTIO_ chain and every jump to one removed."""
    kept = [line for line in saved.splitlines()
            if not line.startswith(":ISTIO_") and not line.startswith("-A ISTIO_") and "-j ISTIO_" not in line]
    return "\n".join(kept) + "\n"


def apply(config: CaptureConfig) -> None:
    """Install the capture in the current network namespace, replacing any earlier one."""
    clean()
    run_command(["iptables-restore", "--noflush"], render(config))


def clean(tables: tuple[str, ...] = ("nat",), enter: tuple[str, ...] = ()) -> bool:
    """Remove the capture (istio-clean-iptables): each table is rewritten without it, atomically.

    `enter` prefixes each command (nsenter into another network namespace). True if any was there."""
    found = False
    for table in tables:
        saved = run_command([*enter, "iptables-save", "-t", table], None)
        if "ISTIO_" in saved:
            # -w: the xtables lock is one file for every namespace of the host, so others may hold it.
            run_command([*enter, "iptables-restore", "-w", "10", "-T", table], without_capture(saved))
            found = True
    return found


def run_command(command: list[str], stdin: str | None) -> str:
    """Run a capture tool; its failure is an IptablesError in one line."""
    try:
        done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise IptablesError(f"{command[0]} is not installed (Debian's package `iptables`)") from None
    if done.returncode != 0:
        raise IptablesError(f"{' '.join(command)} failed: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def add_iptables_flags(parser: argparse.ArgumentParser) -> None:
    """istio-iptables' short flags with their long names; values as Istio's injector passes them."""
    parser.add_argument("-p", "--envoy-port", type=_port, default=15001, help="outbound capture port (15001)")
    parser.add_argument("-z", "--inbound-capture-port", type=_port, default=15006, help="inbound capture port (15006)")
    parser.add_argument("-u", "--proxy-uid", default="1337", help="Envoy's uid(s), comma-separated, never captured")
    parser.add_argument("-g", "--proxy-gid", default="1337", help="Envoy's gid(s), comma-separated, never captured")
    parser.add_argument("-m", "--istio-inbound-interception-mode", default="REDIRECT",
                        help="only REDIRECT is implemented (TPROXY is refused)")
    parser.add_argument("-i", "--istio-service-cidr", default="*",
                        help="outbound CIDRs to capture, comma-separated, or * (default)")
    parser.add_argument("-x", "--istio-service-exclude-cidr", default="", help="outbound CIDRs never captured")
    parser.add_argument("-b", "--istio-inbound-ports", default="*",
                        help="inbound ports to capture, comma-separated, or * (default); empty captures none")
    parser.add_argument("-d", "--istio-local-exclude-ports",
                        default=",".join(map(str, DEFAULT_EXCLUDED_INBOUND_PORTS)),
                        help="inbound ports never captured when -b is * (default 15090,15021,15020)")
    parser.add_argument("-o", "--istio-local-outbound-ports-exclude", default="", help="outbound ports never captured")
    parser.add_argument("--dry-run", action="store_true", help="print the iptables-restore input, change nothing")
    parser.add_argument("--clean", action="store_true", help="remove the capture instead (istio-clean-iptables)")


def config_from_args(args: argparse.Namespace) -> CaptureConfig:
    if args.istio_inbound_interception_mode != "REDIRECT":
        raise IptablesError(f"-m {args.istio_inbound_interception_mode}: only REDIRECT is implemented")
    include_cidrs = _split(args.istio_service_cidr)
    return CaptureConfig(
        outbound_port=args.envoy_port,
        inbound_port=args.inbound_capture_port,
        proxy_uid=_ids(args.proxy_uid, "-u"),
        proxy_gid=_ids(args.proxy_gid, "-g"),
        include_cidrs=include_cidrs if include_cidrs == ("*",) else tuple(_cidr(c, "-i") for c in include_cidrs),
        exclude_cidrs=tuple(_cidr(c, "-x") for c in _split(args.istio_service_exclude_cidr)),
        include_inbound_ports=_ports_or_star(args.istio_inbound_ports, "-b"),
        exclude_inbound_ports=tuple(_flag_port(p, "-d") for p in _split(args.istio_local_exclude_ports)),
        exclude_outbound_ports=tuple(_flag_port(p, "-o") for p in _split(args.istio_local_outbound_ports_exclude)),
    )


def run_iptables(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        if args.dry_run:
            print(render(config) if not args.clean else "# would remove the ISTIO_ chains from the nat table", end="")
            return 0
        if args.clean:
            clean()
            log.info("removed the traffic capture")
        else:
            apply(config)
            log.info("installed the traffic capture: outbound to %d, inbound to %d, uid %s and gid %s exempt",
                     config.outbound_port, config.inbound_port, config.proxy_uid, config.proxy_gid)
    except IptablesError as error:
        log.error("%s", error)
        return 1
    return 0


def _split(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {value!r}") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"not a port: {value!r}")
    return port


def _flag_port(value: str, flag: str) -> int:
    try:
        return _port(value)
    except argparse.ArgumentTypeError as error:
        raise IptablesError(f"{flag}: {error}") from None


def _ports_or_star(value: str, flag: str) -> tuple[str, ...]:
    parts = _split(value)
    return parts if parts == ("*",) else tuple(str(_flag_port(p, flag)) for p in parts)


def _ids(value: str, flag: str) -> str:
    parts = _split(value)
    if not parts or not all(p.isdigit() for p in parts):
        raise IptablesError(f"{flag}: not a list of numeric ids: {value!r}")
    return ",".join(parts)


def _cidr(value: str, flag: str) -> str:
    try:
        network = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise IptablesError(f"{flag}: not a CIDR: {value!r}") from None
    if network.version != 4:
        raise IptablesError(f"{flag}: {value}: only IPv4 capture is implemented")
    return str(network)

"""Flags and environment -> one frozen Settings object for `istiod discovery`."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from istiod.model.names import DEFAULT_DOMAIN


@dataclass(frozen=True, slots=True)
class Address:
    host: str  # "" means every interface
    port: int  # 0 picks a free port

    @classmethod
    def parse(cls, text: str) -> Address:
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise argparse.ArgumentTypeError(f"address {text!r} must be [host]:port")
        return cls(host.strip("[]"), int(port))

    @property
    def bind_host(self) -> str:
        return self.host or "0.0.0.0"

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Settings:
    config_dir: Path | None
    grpc_addr: Address
    http_addr: Address
    domain: str = DEFAULT_DOMAIN
    debounce_after: float = 0.1
    debounce_max: float = 1.0
    push_concurrency: int = 100
    poll_interval: float = 0.25
    ports_file: Path | None = None
    monitoring_addr: Address = Address("", 15014)
    debug_token_file: Path | None = None  # a bearer token that lets non-loopback callers read /debug


def add_discovery_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--config-dir", type=Path, help="read Kubernetes YAML from this directory")
    parser.add_argument("--grpc-addr", type=Address.parse, default=Address.parse(env("GRPC_ADDR", ":15010")),
                        help="plaintext xDS (default :15010)")
    parser.add_argument("--http-addr", type=Address.parse, default=Address.parse(env("HTTP_ADDR", ":8080")),
                        help="debug endpoints and /ready (default :8080)")
    parser.add_argument("--monitoring-addr", type=Address.parse,
                        default=Address.parse(env("MONITORING_ADDR", ":15014")),
                        help="/metrics, /version and debug endpoints (default :15014)")
    parser.add_argument("--debug-auth-token-file", type=Path,
                        help="a file holding a bearer token that admits non-loopback callers to /debug "
                             "(without it, /debug answers loopback callers only)")
    parser.add_argument("--domain", default=env("DOMAIN_SUFFIX", DEFAULT_DOMAIN), help="cluster DNS domain")
    parser.add_argument("--debounce-after", type=_seconds, default=_seconds(env("PILOT_DEBOUNCE_AFTER", "100ms")),
                        help="quiet time before a push (default 100ms)")
    parser.add_argument("--debounce-max", type=_seconds, default=_seconds(env("PILOT_DEBOUNCE_MAX", "1s")),
                        help="longest a push waits for quiet (default 1s)")
    parser.add_argument("--push-concurrency", type=int, default=int(env("PILOT_PUSH_THROTTLE", "100")),
                        help="connections sending a push at once (default 100)")
    parser.add_argument("--poll-interval", type=_seconds, default=_seconds("250ms"),
                        help="how often the config dir is scanned (default 250ms)")
    parser.add_argument("--ports-file", type=Path,
                        help="write the bound ports as JSON here once serving (for :0 addresses)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    if args.config_dir is None:
        raise SystemExit("istiod discovery: --config-dir is required (Kubernetes sources come later)")
    return Settings(
        config_dir=args.config_dir,
        grpc_addr=args.grpc_addr,
        http_addr=args.http_addr,
        domain=args.domain,
        debounce_after=args.debounce_after,
        debounce_max=args.debounce_max,
        push_concurrency=args.push_concurrency,
        poll_interval=args.poll_interval,
        ports_file=args.ports_file,
        monitoring_addr=args.monitoring_addr,
        debug_token_file=args.debug_auth_token_file,
    )


def _seconds(text: str) -> float:
    """Go-style durations as istiod takes them (`100ms`, `1s`, `2m`) or plain seconds."""
    units = (("ms", 1e-3), ("s", 1.0), ("m", 60.0))
    for suffix, scale in units:
        if text.endswith(suffix) and text[: -len(suffix)].replace(".", "", 1).isdigit():
            return float(text[: -len(suffix)]) * scale
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"duration {text!r} must look like 100ms, 1s or 2m") from None

"""Flags and environment -> one frozen Settings object for `istiod discovery`."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from istiod.ca.settings import CaSettings, add_ca_flags, ca_settings_from_args
from istiod.durations import parse_duration as _seconds
from istiod.leader import LeaseTimings
from istiod.model.mesh import DEFAULT_TRUST_DOMAIN, MeshConfig, OutboundTrafficPolicy
from istiod.model.names import DEFAULT_DOMAIN, join_host_port, split_host_port
from istiod.sources.namespaces import Selector


@dataclass(frozen=True, slots=True)
class Address:
    host: str  # "" means every interface
    port: int  # 0 picks a free port

    @classmethod
    def parse(cls, text: str) -> Address:
        try:
            host, port = split_host_port(text, allow_empty_host=True, allow_zero_port=True)
        except ValueError:
            raise argparse.ArgumentTypeError(f"address {text!r} must be [host]:port") from None
        return cls(host, port)

    @property
    def bind_host(self) -> str:
        return self.host or "0.0.0.0"

    def __str__(self) -> str:
        return join_host_port(self.host, self.port)


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
    kubeconfig: Path | None = None
    in_cluster: bool = False
    discovery_selectors: tuple[str, ...] = ()
    watch_timeout: int = 300
    namespace: str = "istio-system"  # istiod's own (POD_NAMESPACE): its Secret, Lease and serving DNS names
    pod_name: str = ""  # who holds a leader Lease
    leader: LeaseTimings = LeaseTimings()
    secure_grpc_addr: Address = Address("", 15012)
    mesh: MeshConfig = MeshConfig()
    ca: CaSettings = CaSettings()
    monitoring_addr: Address = Address("", 15014)
    debug_token_file: Path | None = None  # a bearer token that lets non-loopback callers read /debug


def add_discovery_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--config-dir", type=Path, help="read Kubernetes YAML from this directory")
    parser.add_argument("--kubeconfig", type=Path, default=Path(env("KUBECONFIG")) if env("KUBECONFIG") else None,
                        help="read from this cluster (in a pod, the in-cluster config is used)")
    parser.add_argument("--discovery-selector", dest="discovery_selectors", action="append", default=[],
                        metavar="SELECTOR",
                        help="only read namespaces whose labels match (key=value,key,!key); repeat to OR")
    parser.add_argument("--watch-timeout", type=int, default=300,
                        help="seconds a Kubernetes watch lasts before it is resumed (default 300)")
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
    parser.add_argument("--secure-grpc-addr", type=Address.parse,
                        default=Address.parse(env("SECURE_GRPC_ADDR", ":15012")), help="xDS and the CA over TLS (default :15012)")
    parser.add_argument("--trust-domain", default=env("TRUST_DOMAIN", DEFAULT_TRUST_DOMAIN), help="SPIFFE trust domain")
    parser.add_argument("--mtls", action="store_true",
                        help="mesh-wide STRICT mTLS (proxyless gRPC and Envoy sidecars); without it sidecars "
                             "accept both (PERMISSIVE) and use mTLS to pods that have a sidecar (default off)")
    parser.add_argument("--outbound-traffic-policy", choices=[p.value for p in OutboundTrafficPolicy],
                        default=OutboundTrafficPolicy.ALLOW_ANY.value,
                        help="meshConfig outboundTrafficPolicy.mode: sidecars pass traffic to unknown hosts "
                             "through (ALLOW_ANY, the default) or drop it (REGISTRY_ONLY)")
    timings = LeaseTimings()
    parser.add_argument("--leader-lease-duration", type=_seconds, default=timings.duration,
                        help="a leader's Lease lapses after this long without renewal (default 30s)")
    parser.add_argument("--leader-renew-deadline", type=_seconds, default=timings.renew_deadline,
                        help="a leader that could not renew for this long stops leading (default 15s)")
    parser.add_argument("--leader-retry-period", type=_seconds, default=timings.retry_period,
                        help="how often a leader renews and the others try to take over (default 7.5s)")
    add_ca_flags(parser)


def settings_from_args(args: argparse.Namespace) -> Settings:
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and args.kubeconfig is None
    if args.config_dir is None and args.kubeconfig is None and not in_cluster:
        raise SystemExit("istiod discovery: give --config-dir or --kubeconfig (or run in a pod)")
    if args.config_dir is not None and args.kubeconfig is not None:
        raise SystemExit("istiod discovery: --config-dir and --kubeconfig are alternatives; give one")
    for selector in args.discovery_selectors:
        try:
            Selector.parse(selector)
        except ValueError as error:
            raise SystemExit(f"istiod discovery: {error}") from None
    leader = LeaseTimings(args.leader_lease_duration, args.leader_renew_deadline, args.leader_retry_period)
    try:
        leader.check()
    except ValueError as error:
        raise SystemExit(f"istiod discovery: {error}") from None
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
        kubeconfig=args.kubeconfig,
        in_cluster=in_cluster and args.config_dir is None,
        discovery_selectors=tuple(args.discovery_selectors),
        watch_timeout=args.watch_timeout,
        namespace=os.environ.get("POD_NAMESPACE", "istio-system"),
        # Outside a pod, two istiods on one host must not share an identity.
        pod_name=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
        leader=leader,
        secure_grpc_addr=args.secure_grpc_addr,
        mesh=MeshConfig(trust_domain=args.trust_domain, mtls=args.mtls,
                        outbound_traffic_policy=OutboundTrafficPolicy(args.outbound_traffic_policy)),
        ca=ca_settings_from_args(args),
        monitoring_addr=args.monitoring_addr,
        debug_token_file=args.debug_auth_token_file,
    )

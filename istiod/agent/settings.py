"""`istiod agent` flags (Istio's environment variables as defaults) -> one frozen AgentSettings."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from istiod.agent.admin import EnvoyAdmin
from istiod.agent.bootstrap import CertFiles, NodeInfo
from istiod.agent.proxy_config import ProxyConfigError, parse_proxy_config
from istiod.model.probe import ReadinessProbe
from istiod.durations import parse_duration
from istiod.envvars import env_default
from istiod.model.mesh import DEFAULT_TRUST_DOMAIN
from istiod.model.names import check_account, split_host_port

DEFAULT_CA_ADDRESS = "istiod.istio-system.svc:15012"


@dataclass(frozen=True, slots=True)
class AgentSettings:
    ca_address: str
    ca_root_cert: Path  # what the agent trusts when it dials the CA
    token_file: Path
    certs: CertFiles
    bootstrap_file: Path
    xds_address: str
    node: NodeInfo
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    cert_ttl: float = 86400.0  # seconds requested from the CA
    ca_timeout: float = 10.0


def add_agent_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--ca-addr", default=env("CA_ADDR", DEFAULT_CA_ADDRESS), help="istiod's CA (TLS)")
    parser.add_argument("--xds-addr", default=env("XDS_ADDR"), help="istiod's xDS over TLS (default: --ca-addr)")
    parser.add_argument("--ca-root-cert", type=Path, default=Path(env("CA_ROOT_CERT", "/var/run/secrets/istio/root-cert.pem")),
                        help="the root istiod's certificate chains to (istio-ca-root-cert ConfigMap)")
    parser.add_argument("--token-file", type=Path, default=Path(env("TOKEN_FILE", "/var/run/secrets/tokens/istio-token")),
                        help="service-account token (audience istio-ca)")
    parser.add_argument("--output-dir", type=Path, default=Path(env("OUTPUT_CERTS", "/var/lib/istio/data")),
                        help="where cert-chain.pem, key.pem and root-cert.pem are written")
    parser.add_argument("--bootstrap", type=Path, default=Path(env("GRPC_XDS_BOOTSTRAP", "/etc/istio/proxy/grpc-bootstrap.json")),
                        help="where the gRPC xDS bootstrap is written")
    # Required, but checked in agent_settings_from_args: `istiod agent iptables` does not need them.
    parser.add_argument("--pod-name", default=env("POD_NAME"))
    parser.add_argument("--pod-namespace", default=env("POD_NAMESPACE"))
    parser.add_argument("--instance-ip", default=env("INSTANCE_IP"))
    parser.add_argument("--service-account", default=env("SERVICE_ACCOUNT", "default"))
    parser.add_argument("--cluster-id", default=env("ISTIO_META_CLUSTER_ID", "Kubernetes"))
    parser.add_argument("--trust-domain", default=env("TRUST_DOMAIN", DEFAULT_TRUST_DOMAIN))
    parser.add_argument("--cert-ttl", type=parse_duration, default=env_default("SECRET_TTL", "24h", parse_duration),
                        help="certificate lifetime to ask for; renewed at half of it (default 24h)")
    parser.add_argument("--cert-refresh-interval", type=parse_duration, default=parse_duration("15m"),
                        help="how often gRPC re-reads the certificate files (default 15m)")


def agent_settings_from_args(args: argparse.Namespace) -> AgentSettings:
    missing = [f"{flag} (or {variable})" for flag, variable, value in (
        ("--pod-name", "POD_NAME", args.pod_name), ("--pod-namespace", "POD_NAMESPACE", args.pod_namespace),
        ("--instance-ip", "INSTANCE_IP", args.instance_ip)) if value is None]
    if missing:
        raise SystemExit(f"istiod agent: required: {', '.join(missing)}")
    try:
        check_account(args.pod_namespace, args.service_account)
    except ValueError as error:
        raise SystemExit(f"istiod agent: --pod-namespace/--service-account: {error}") from None
    node = NodeInfo(ip=args.instance_ip, pod=args.pod_name, namespace=args.pod_namespace,
                    service_account=args.service_account, cluster_id=args.cluster_id,
                    proxy_type=getattr(args, "proxy_type", "sidecar"))
    return AgentSettings(
        ca_address=args.ca_addr,
        ca_root_cert=args.ca_root_cert,
        token_file=args.token_file,
        certs=CertFiles(args.output_dir, args.cert_refresh_interval),
        bootstrap_file=args.bootstrap,
        xds_address=args.xds_addr or args.ca_addr,
        node=node,
        trust_domain=args.trust_domain,
        cert_ttl=args.cert_ttl,
    )

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """`istiod agent proxy`: the Envoy sidecar's side of the agent."""

    workdir: Path  # Envoy's working directory: the bootstrap's Unix socket paths are relative to it
    admin: EnvoyAdmin = EnvoyAdmin(("127.0.0.1", 15000))
    status: tuple[str, int] = ("", 15020)
    readiness: tuple[str, int] = ("", 15021)
    prometheus: tuple[str, int] = ("", 15090)  # Envoy's own listener for its stats
    drain_duration: float = 5.0  # terminationDrainDuration
    envoy_drain_time: float = 45.0  # drainDuration: Envoy's --drain-time-s
    log_level: str = "warning"
    component_log_level: str = "misc:error"
    concurrency: int = 2
    bootstrap_override: Path | None = None
    metadata: tuple[tuple[str, str], ...] = ()  # the environment's ISTIO_META_* and ISTIO_METAJSON_* values
    stats_matcher: Mapping[str, tuple[str, ...]] | None = None  # proxyStatsMatcher
    ignored: tuple[str, ...] = ()  # PROXY_CONFIG's fields this agent does not apply
    readiness_probe: ReadinessProbe | None = None  # PROXY_CONFIG's: run here, its result told to istiod
    proxy_config: Mapping[str, Any] | None = None  # PROXY_CONFIG as read (node metadata PROXY_CONFIG, as pilot-agent's)


def _listen_address(text: str) -> tuple[str, int]:
    try:
        return split_host_port(text, allow_empty_host=True, allow_zero_port=True)
    except ValueError:
        raise argparse.ArgumentTypeError(f"address {text!r} must be [host]:port") from None


def _admin_address(text: str) -> tuple[str, int] | Path:
    if text.startswith("unix:"):
        return Path(text.removeprefix("unix:"))
    try:
        return split_host_port(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"address {text!r} must be host:port with a port other than 0, or unix:PATH") from None


def add_proxy_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("proxy_type", nargs="?", choices=("sidecar", "router", "waypoint"), default="sidecar",
                        help="sidecar (default), router: an ingress gateway, served the Gateways selecting its labels, "
                             "or waypoint: the waypoint its gateway.networking.k8s.io/gateway-name label names")
    parser.add_argument("--workdir", type=Path, default=Path("."),
                        help="Envoy's working directory, under which the agent serves ./etc/istio/proxy/XDS and "
                             "./var/run/secrets/workload-spiffe-uds/socket and writes ./etc/istio/proxy/envoy-rev.json "
                             "(default: the current directory, as pilot-agent's /)")
    parser.add_argument("--proxy-admin-addr", type=_admin_address, default=_admin_address("127.0.0.1:15000"),
                        help="Envoy's admin address: host:port (default 127.0.0.1:15000), or unix:PATH (relative to "
                             "--workdir), which the agent reaches from outside the pod's network namespace")
    parser.add_argument("--status-addr", type=_listen_address,
                        default=_listen_address(f":{env('STATUS_PORT')}") if env("STATUS_PORT") else None,
                        help="/stats/prometheus (Envoy's and the agent's) and /healthz/ready (default "
                             ":<PROXY_CONFIG's statusPort>, else :15020)")
    parser.add_argument("--readiness-addr", type=_listen_address, default=_listen_address(":15021"),
                        help="/healthz/ready: Envoy is LIVE and the agent is not draining (default :15021)")
    parser.add_argument("--envoy-prometheus-addr", type=_listen_address, default=_listen_address(":15090"),
                        help="Envoy's listener for its /stats/prometheus (default :15090)")
    seconds = env("TERMINATION_DRAIN_DURATION_SECONDS")
    parser.add_argument("--termination-drain-duration", type=parse_duration, default=f"{seconds}s" if seconds else None,
                        help="after SIGTERM, how long Envoy drains before it is stopped (default PROXY_CONFIG's "
                             "terminationDrainDuration, else 5s)")
    parser.add_argument("--proxy-log-level", default="warning", help="Envoy's log level (default warning)")
    parser.add_argument("--proxy-component-log-level", default="misc:error",
                        help="Envoy's per-component log levels (default misc:error)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="Envoy's worker threads (default PROXY_CONFIG's concurrency, else 2; 0: one per CPU)")
    parser.add_argument("--bootstrap-override", type=Path, default=env("ISTIO_BOOTSTRAP_OVERRIDE"),
                        help="a JSON or YAML file merged into the generated Envoy bootstrap (ISTIO_BOOTSTRAP_OVERRIDE)")


def proxy_settings_from_args(args: argparse.Namespace) -> ProxySettings:
    """The flags, then PROXY_CONFIG (the pod's ProxyConfig, as pilot-agent reads it: a flag set wins),
    then the defaults. proxyMetadata entries are the agent's environment, over the pod's own."""
    try:
        config = parse_proxy_config(os.environ.get("PROXY_CONFIG", ""))
    except ProxyConfigError as error:
        raise SystemExit(f"istiod agent proxy: {error}") from None
    workdir = args.workdir.absolute()
    admin = workdir / args.proxy_admin_addr if isinstance(args.proxy_admin_addr, Path) else args.proxy_admin_addr
    environ = {**os.environ, **dict(config.proxy_metadata)}
    metadata = tuple((name, value) for name, value in sorted(environ.items())
                     if name.startswith(("ISTIO_META_", "ISTIO_METAJSON_")))
    status = args.status_addr or ("", config.status_port if config.status_port is not None else 15020)
    return ProxySettings(
        workdir=workdir, admin=EnvoyAdmin(admin), status=status,
        readiness=args.readiness_addr, prometheus=args.envoy_prometheus_addr,
        drain_duration=_first(args.termination_drain_duration, config.termination_drain_duration, 5.0),
        envoy_drain_time=_first(config.drain_duration, 45.0),
        log_level=args.proxy_log_level, component_log_level=args.proxy_component_log_level,
        concurrency=_first(args.concurrency, config.concurrency, 2), bootstrap_override=args.bootstrap_override,
        metadata=metadata, stats_matcher=config.stats_matcher, ignored=config.ignored,
        readiness_probe=config.readiness_probe, proxy_config=config.as_read,
    )


def _first(*values: T | None) -> T:
    """The first value set (the last one always is)."""
    found = next(v for v in values if v is not None)
    assert found is not None
    return found

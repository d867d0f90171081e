"""Flags and environment -> one frozen Settings object for `istiod discovery`."""

from __future__ import annotations

import argparse
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from istiod.ca.settings import CaSettings, add_ca_flags, ca_settings_from_args
from istiod.connlimit import HTTP_READ_TIMEOUT, MAX_CONNECTIONS
from istiod.durations import parse_duration as _seconds
from istiod.envvars import env_default, parse_bool
from istiod.keepalive import Keepalive
from istiod.leader import LeaseTimings
from istiod.model.mesh import DEFAULT_TRUST_DOMAIN, MeshConfig, OutboundTrafficPolicy
from istiod.model.names import DEFAULT_DOMAIN, DNS_1123_LABEL, join_host_port, split_host_port
from istiod.sources.namespaces import parse_selector
from istiod.xds.admission import DEFAULT_RATE


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
    debounce_max: float = 10.0
    eds_debounce: bool = True  # PILOT_ENABLE_EDS_DEBOUNCE: off pushes endpoint-only changes at once
    push_concurrency: int = 100
    poll_interval: float = 0.25
    ports_file: Path | None = None
    kubeconfig: Path | None = None
    in_cluster: bool = False
    discovery_selectors: tuple[str, ...] = ()
    watch_timeout: int = 300
    namespace: str = "istio-system"  # istiod's own (POD_NAMESPACE): its Secret, leader lock and serving DNS names
    pod_name: str = ""  # who holds a leader lock
    leader: LeaseTimings = LeaseTimings()
    analysis: bool = False  # PILOT_ENABLE_ANALYSIS: the leader writes analysis messages to Istio objects' status
    analysis_interval: float = 10.0  # PILOT_ANALYSIS_INTERVAL: longest a change waits for its analysis
    jwks_refresh_interval: float = 20 * 60.0  # PILOT_JWT_PUB_KEY_REFRESH_INTERVAL: how often jwksUris are fetched again
    # WorkloadEntry auto-registration and health (istiod/autoregistration.py), Istio's variables:
    # PILOT_ENABLE_WORKLOAD_ENTRY_AUTOREGISTRATION, PILOT_ENABLE_WORKLOAD_ENTRY_HEALTHCHECKS,
    # PILOT_WORKLOAD_ENTRY_GRACE_PERIOD, ISTIO_WORKLOAD_ENTRY_VALIDATE_IDENTITY.
    workload_entry_autoregistration: bool = True
    workload_entry_health_checks: bool = True
    workload_entry_grace: float = 10.0
    workload_entry_validate_identity: bool = True
    secure_grpc_addr: Address = Address("", 15012)
    mesh: MeshConfig = MeshConfig()
    ca: CaSettings = CaSettings()
    monitoring_addr: Address = Address("", 15014)
    debug_token_file: Path | None = None  # a bearer token that lets non-loopback callers read /debug
    # istiod's environment only: the xDS debug types need a proven identity (ENABLE_DEBUG_ENDPOINT_AUTH), and
    # one outside the system namespace sees its own namespace's proxies unless listed here
    # (DEBUG_ENDPOINT_AUTH_ALLOWED_NAMESPACES).
    debug_endpoint_auth: bool = True
    debug_auth_allowed_namespaces: frozenset[str] = frozenset()
    keepalive: Keepalive = Keepalive()  # both xDS ports
    max_requests_per_second: float = DEFAULT_RATE  # 0: no limit; new xDS streams admitted a second (PILOT_MAX_REQUESTS_PER_SECOND)
    xds_send_timeout: float = 5.0  # a stream whose client takes no response for this long is closed; 0: never
    xds_workers: int = 1  # > 1: processes serving --grpc-addr (istiod/xds/workers.py); 1: this one
    shutdown_duration: float = 10.0  # after SIGTERM: xDS streams drain this long, then are closed
    max_connections: int = MAX_CONNECTIONS  # per port: 8080, 15014, 15017, 15012's TLS front and 15010 (sized to the fd limit at start)
    http_read_timeout: float = HTTP_READ_TIMEOUT  # a connection to 8080 or 15014 must send its request within this
    webhook_addr: Address = Address("", 15017)
    mesh_config: Path | None = None  # watched; in a cluster without it, the ConfigMap `istio` key `mesh`
    mesh_defaults: MeshConfig = MeshConfig()  # the flags' values, under whatever the mesh config sets
    networks_config: Path | None = None  # meshNetworks, watched; its gateways win over the mesh config's
    injection_dir: Path | None = None  # `config` and `values`; in a cluster without it, the ConfigMap istio-sidecar-injector
    revision: str = "default"  # istio.io/rev this control plane serves: its config, webhooks and names (istiod's REVISION)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def add_discovery_flags(parser: argparse.ArgumentParser) -> None:
    # pilot-discovery's camelCase spellings are aliases, so istiod's manifests and habits work unchanged.
    env = os.environ.get
    parser.add_argument("--config-dir", "--configDir", type=Path, help="read Kubernetes YAML from this directory")
    parser.add_argument("--kubeconfig", type=Path,
                        help="read from this cluster (default $KUBECONFIG unless --config-dir is given;"
                             " in a pod, the in-cluster config)")
    parser.add_argument("--mesh-config", "--meshConfig", type=Path,
                        help="Istio mesh config YAML (trustDomain, rootNamespace, outboundTrafficPolicy, "
                             "enableAutoMtls, defaultConfig, discoverySelectors), watched; its fields win over "
                             "the flags (in a cluster without it: the ConfigMap istio, key mesh, in istiod's namespace)")
    parser.add_argument("--networks-config", "--networksConfig", type=Path,
                        help="Istio mesh networks YAML (networks: gateways), watched, when the file exists "
                             "(else in a cluster: the ConfigMap istio, key meshNetworks)")
    parser.add_argument("--discovery-selector", dest="discovery_selectors", action="append", default=[],
                        metavar="SELECTOR",
                        help="only read namespaces whose labels match this Kubernetes label selector"
                             " (key=value,key!=value,key,!key,key in (a,b),key notin (a,b)); repeat to OR")
    parser.add_argument("--watch-timeout", type=_seconds, default=300.0,
                        help="how long a Kubernetes watch lasts before it is resumed (default 5m)")
    parser.add_argument("--grpc-addr", "--grpcAddr", type=Address.parse,
                        default=env_default("GRPC_ADDR", ":15010", Address.parse),
                        help="plaintext xDS (default :15010, every interface)")
    parser.add_argument("--http-addr", "--httpAddr", type=Address.parse,
                        default=env_default("HTTP_ADDR", ":8080", Address.parse),
                        help="debug endpoints and /ready (default :8080, every interface)")
    parser.add_argument("--monitoring-addr", "--monitoringAddr", type=Address.parse,
                        default=env_default("MONITORING_ADDR", ":15014", Address.parse),
                        help="/metrics, /version and debug endpoints (default :15014, every interface)")
    parser.add_argument("--debug-auth-token-file", type=Path,
                        help="a file holding a bearer token that admits non-loopback callers to /debug "
                             "(without it, /debug answers loopback callers only)")
    parser.add_argument("--domain", default=env("DOMAIN_SUFFIX", DEFAULT_DOMAIN),
                        help="cluster DNS domain (default cluster.local)")
    parser.add_argument("--debounce-after", type=_seconds, default=env_default("PILOT_DEBOUNCE_AFTER", "100ms", _seconds),
                        help="quiet time before a push (default 100ms)")
    parser.add_argument("--debounce-max", type=_seconds, default=env_default("PILOT_DEBOUNCE_MAX", "10s", _seconds),
                        help="longest a push waits for quiet (default 10s)")
    parser.add_argument("--enable-eds-debounce", dest="eds_debounce", type=parse_bool,
                        default=env_default("PILOT_ENABLE_EDS_DEBOUNCE", "true", parse_bool),
                        help="hold changes that only move endpoints for --debounce-after; false pushes them"
                             " at once (default true)")
    parser.add_argument("--enable-analysis", dest="analysis", type=parse_bool,
                        default=env_default("PILOT_ENABLE_ANALYSIS", "false", parse_bool),
                        help="with a cluster, the elected replica writes analysis messages to Istio objects'"
                             " status (default false)")
    parser.add_argument("--analysis-interval", type=_seconds,
                        default=env_default("PILOT_ANALYSIS_INTERVAL", "10s", _seconds),
                        help="longest a change waits for its analysis (default 10s)")
    parser.add_argument("--push-concurrency", type=_positive_int,
                        default=env_default("PILOT_PUSH_THROTTLE", "100", _positive_int),
                        help="connections sending a push at once (default 100)")
    parser.add_argument("--poll-interval", type=_seconds, default=_seconds("250ms"),
                        help="how often the config dir is scanned when file events are unavailable (default 250ms)")
    parser.add_argument("--ports-file", type=Path,
                        help="write the bound ports as JSON here once serving (for :0 addresses)")
    parser.add_argument("--secure-grpc-addr", type=Address.parse,
                        default=env_default("SECURE_GRPC_ADDR", ":15012", Address.parse),
                        help="xDS and the CA over TLS (default :15012, every interface)")
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
                        help="a leader's lock lapses after this long without renewal (default 30s)")
    parser.add_argument("--leader-renew-deadline", type=_seconds, default=timings.renew_deadline,
                        help="a leader that could not renew for this long stops leading (default 15s)")
    parser.add_argument("--leader-retry-period", type=_seconds, default=timings.retry_period,
                        help="how often a leader renews and the others try to take over (default 7.5s)")
    keepalive = Keepalive()
    parser.add_argument("--keepalive-interval", "--keepaliveInterval", dest="keepalive_interval", type=_seconds,
                        default=keepalive.time, help="xDS ports: ping a connection quiet for this long (default 30s)")
    parser.add_argument("--keepalive-timeout", "--keepaliveTimeout", dest="keepalive_timeout", type=_seconds,
                        default=keepalive.timeout,
                        help="xDS ports: close a connection whose ping is not answered within this (default 10s)")
    parser.add_argument("--keepalive-max-server-connection-age", "--keepaliveMaxServerConnectionAge",
                        dest="keepalive_max_server_connection_age", type=_seconds, default=1800.0,
                        help="xDS ports: close connections gracefully at this age, so clients spread over"
                             " replicas; 0 never (default 30m, as Istio's chart sets)")
    parser.add_argument("--shutdown-duration", "--shutdownDuration", dest="shutdown_duration", type=_seconds,
                        default=10.0, help="after SIGTERM, /ready fails and new xDS streams are refused at once; open"
                                           " ones get a GOAWAY and are closed after this (default 10s, as istiod)")
    parser.add_argument("--xds-send-timeout", type=_seconds, default=env_default("PILOT_XDS_SEND_TIMEOUT", "5s", _seconds),
                        help="close an xDS stream whose client takes no response for this long; 0 never (default 5s)")
    parser.add_argument("--xds-workers", type=_positive_int, default=1,
                        help="worker processes that share --grpc-addr and serve its xDS connections from the same "
                             "snapshots; 1: served by istiod's own process (default 1). --secure-grpc-addr (xDS over "
                             "TLS, the CA) is served by istiod's own process either way")
    parser.add_argument("--max-requests-per-second", type=_non_negative_float,
                        default=env_default("PILOT_MAX_REQUESTS_PER_SECOND", f"{DEFAULT_RATE:g}", _non_negative_float),
                        help="new xDS streams admitted a second; one that would wait over 1s for its turn is refused "
                             f"with RESOURCE_EXHAUSTED; 0: no limit (default {DEFAULT_RATE:g}; istiod's is 25 on 2 cores)")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                        help="connections per port on 8080, 15014, 15017, 15012 and 15010; beyond it the longest idle "
                             "one that has not sent a request is closed (15010: the new one is); lowered, with a warning, "
                             f"to what the open files limit can hold (default {MAX_CONNECTIONS})")
    parser.add_argument("--http-read-timeout", type=_seconds, default=HTTP_READ_TIMEOUT,
                        help="8080, 15014 and 15017: a connection's request must arrive within this (default 30s)")
    parser.add_argument("--webhook-addr", "--httpsAddr", type=Address.parse,
                        default=env_default("HTTPS_ADDR", ":15017", Address.parse),
                        help="the webhooks over HTTPS with istiod's certificate: config validation at /validate, "
                             "sidecar injection at /inject (default :15017)")
    parser.add_argument("--injection-dir", type=Path,
                        help="the sidecar injector's files `config` and `values` (the ConfigMap istio-sidecar-injector "
                             "mounted, as istiod's /var/lib/istio/inject), read at start; in a cluster without it, "
                             "that ConfigMap in istiod's namespace, watched")
    parser.add_argument("--revision", default=env("REVISION", "") or "default",
                        help="the control plane revision (istio.io/rev) served: config labelled with another "
                             "revision is ignored, the webhooks labelled istio.io/rev=<revision> are the ones kept "
                             "current, and names take its suffix (istio-<rev>, istio-sidecar-injector-<rev>) "
                             "(default $REVISION, else default)")
    add_ca_flags(parser)


def settings_from_args(args: argparse.Namespace) -> Settings:
    kubeconfig = args.kubeconfig
    if args.config_dir is not None and kubeconfig is not None:
        raise SystemExit("istiod discovery: --config-dir and --kubeconfig are alternatives; give one")
    if args.config_dir is None and kubeconfig is None and os.environ.get("KUBECONFIG"):
        kubeconfig = Path(os.environ["KUBECONFIG"])  # an explicit --config-dir wins over the environment
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and args.config_dir is None and kubeconfig is None
    if args.config_dir is None and kubeconfig is None and not in_cluster:
        raise SystemExit("istiod discovery: give --config-dir or --kubeconfig (or run in a pod)")
    if args.watch_timeout < 1:
        raise SystemExit("istiod discovery: --watch-timeout must be 1s or more")
    for selector in args.discovery_selectors:
        try:
            parse_selector(selector)
        except ValueError as error:
            raise SystemExit(f"istiod discovery: {error}") from None
    for flag, value in (("--keepalive-interval", args.keepalive_interval), ("--keepalive-timeout", args.keepalive_timeout),
                        ("--max-connections", args.max_connections), ("--http-read-timeout", args.http_read_timeout)):
        if not value > 0:
            raise SystemExit(f"istiod discovery: {flag} must be positive")
    age = args.keepalive_max_server_connection_age
    keepalive = Keepalive(args.keepalive_interval, args.keepalive_timeout, age if age else math.inf)
    leader = LeaseTimings(args.leader_lease_duration, args.leader_renew_deadline, args.leader_retry_period)
    try:
        leader.check()
    except ValueError as error:
        raise SystemExit(f"istiod discovery: {error}") from None
    ca = ca_settings_from_args(args)
    # Files and directories last: a flag that contradicts another is the first thing to say.
    _check_dir(args.config_dir, "--config-dir")
    _check_file(kubeconfig, "--kubeconfig" if args.kubeconfig else "KUBECONFIG")
    for path, flag in ((args.debug_auth_token_file, "--debug-auth-token-file"),
                       (args.ca_static_tokens, "--ca-static-tokens"), (args.mesh_config, "--mesh-config")):
        _check_file(path, flag)
    # As istiod: a networks file that does not exist leaves the networks to the ConfigMap's key.
    networks_config = args.networks_config if args.networks_config and args.networks_config.exists() else None
    _check_file(networks_config, "--networksConfig")
    _check_dir(args.plugged_ca_dir, "--plugged-ca-dir")
    _check_dir(args.injection_dir, "--injection-dir")
    if not DNS_1123_LABEL.fullmatch(args.revision):
        raise SystemExit(f"istiod discovery: --revision {args.revision!r}: not a DNS-1123 label")
    if args.ports_file is not None:
        _check_dir(args.ports_file.parent, "--ports-file: the directory")
    if args.config_dir is not None and args.ca_state_dir.exists():  # else created at start; unused with a cluster
        _check_dir(args.ca_state_dir, "--ca-state-dir")
    namespace = os.environ.get("POD_NAMESPACE", "istio-system")
    defaults = MeshConfig(trust_domain=args.trust_domain, mtls=args.mtls,
                          outbound_traffic_policy=OutboundTrafficPolicy(args.outbound_traffic_policy),
                          system_namespace=namespace)
    return Settings(
        config_dir=args.config_dir,
        grpc_addr=args.grpc_addr,
        http_addr=args.http_addr,
        domain=args.domain,
        debounce_after=args.debounce_after,
        debounce_max=args.debounce_max,
        eds_debounce=args.eds_debounce,
        push_concurrency=args.push_concurrency,
        poll_interval=args.poll_interval,
        ports_file=args.ports_file,
        kubeconfig=kubeconfig,
        in_cluster=in_cluster,
        discovery_selectors=tuple(args.discovery_selectors),
        watch_timeout=int(args.watch_timeout),
        mesh_config=args.mesh_config,
        namespace=namespace,
        # Outside a pod, two istiods on one host must not share an identity.
        pod_name=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
        leader=leader,
        analysis=args.analysis,
        analysis_interval=args.analysis_interval,
        jwks_refresh_interval=env_default("PILOT_JWT_PUB_KEY_REFRESH_INTERVAL", "20m", _seconds),
        workload_entry_autoregistration=env_default("PILOT_ENABLE_WORKLOAD_ENTRY_AUTOREGISTRATION", "true", parse_bool),
        workload_entry_health_checks=env_default("PILOT_ENABLE_WORKLOAD_ENTRY_HEALTHCHECKS", "true", parse_bool),
        workload_entry_grace=env_default("PILOT_WORKLOAD_ENTRY_GRACE_PERIOD", "10s", _seconds),
        workload_entry_validate_identity=env_default("ISTIO_WORKLOAD_ENTRY_VALIDATE_IDENTITY", "true", parse_bool),
        secure_grpc_addr=args.secure_grpc_addr,
        mesh=_mesh(args.mesh_config, networks_config, defaults),
        networks_config=networks_config,
        mesh_defaults=defaults,
        webhook_addr=args.webhook_addr,
        ca=ca,
        monitoring_addr=args.monitoring_addr,
        debug_token_file=args.debug_auth_token_file,
        debug_endpoint_auth=env_default("ENABLE_DEBUG_ENDPOINT_AUTH", "true", parse_bool),
        debug_auth_allowed_namespaces=frozenset(
            filter(None, os.environ.get("DEBUG_ENDPOINT_AUTH_ALLOWED_NAMESPACES", "").split(","))),
        keepalive=keepalive,
        xds_send_timeout=args.xds_send_timeout,
        max_requests_per_second=args.max_requests_per_second,
        xds_workers=args.xds_workers,
        shutdown_duration=args.shutdown_duration,
        max_connections=args.max_connections,
        http_read_timeout=args.http_read_timeout,
        injection_dir=args.injection_dir,
        revision=args.revision,
    )


def _check_dir(path: Path | None, flag: str) -> None:
    if path is not None and not path.is_dir():
        raise SystemExit(f"istiod discovery: {flag} {path}: "
                         f"{'is not a directory' if path.exists() else 'no such directory'}")


def _check_file(path: Path | None, flag: str) -> None:
    if path is not None and not path.is_file():
        raise SystemExit(f"istiod discovery: {flag} {path}: {'is not a file' if path.exists() else 'no such file'}")


def _mesh(path: Path | None, networks: Path | None, defaults: MeshConfig) -> MeshConfig:
    """The flags' mesh config under what the mesh config file sets, with the networks file's gateways."""
    # Late: the watcher module loads the Kubernetes client, which the other commands do without.
    from istiod.sources.meshconfig import MeshConfigError, read_mesh_file, read_mesh_networks_file

    try:
        mesh = read_mesh_file(path, defaults) if path else defaults
    except MeshConfigError as error:
        raise SystemExit(f"istiod discovery: --mesh-config: {error}") from None
    try:
        return read_mesh_networks_file(networks).apply(mesh) if networks else mesh
    except MeshConfigError as error:
        raise SystemExit(f"istiod discovery: --networksConfig: {error}") from None

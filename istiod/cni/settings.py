"""`istiod cni` flags (istio-cni's names and environment variables) -> one frozen CniSettings."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from istiod.durations import parse_duration
from istiod.envvars import env_default, parse_bool


@dataclass(frozen=True, slots=True)
class CniSettings:
    node_name: str
    config_dir: Path | None  # pods from YAML files; else the cluster of `kubeconfig` (None: in-cluster)
    kubeconfig: Path | None
    ztunnel_socket: Path
    run_dir: Path  # the plugin event socket lives here
    conf_dir: Path
    conf_name: str
    bin_dir: Path | None
    chained: bool
    netns_dir: Path
    dns_capture: bool
    exclude_namespaces: tuple[str, ...]
    ack_timeout: float
    resync: float
    log_level: str


def add_cni_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--node-name", default=env("NODE_NAME", ""),
                        help="the node whose pods this agent captures (default $NODE_NAME)")
    parser.add_argument("--config-dir", type=Path, help="read pods and namespaces from this directory of Kubernetes YAML")
    parser.add_argument("--kubeconfig", type=Path,
                        help="read pods and namespaces from this cluster (default $KUBECONFIG unless --config-dir "
                             "is given; in a pod, the in-cluster config)")
    parser.add_argument("--ztunnel-uds-address", type=Path,
                        default=Path(env("ZTUNNEL_UDS_ADDRESS", "/var/run/ztunnel/ztunnel.sock")),
                        help="the ZDS socket ztunnel connects to (default /var/run/ztunnel/ztunnel.sock)")
    parser.add_argument("--cni-agent-run-dir", type=Path, default=Path(env("CNI_AGENT_RUN_DIR", "/var/run/istio-cni")),
                        help="where the plugin finds the agent: pluginevent.sock (default /var/run/istio-cni)")
    parser.add_argument("--mounted-cni-net-dir", type=Path, default=Path(env("MOUNTED_CNI_NET_DIR", "/etc/cni/net.d")),
                        help="the CNI conf dir the plugin is chained into (default /etc/cni/net.d)")
    parser.add_argument("--cni-conf-name", default=env("CNI_CONF_NAME", ""),
                        help="the config file to chain into (default: the first in the conf dir, as the runtime picks)")
    parser.add_argument("--cni-bin-dir", type=Path, default=Path(env("CNI_BIN_DIR", "/opt/cni/bin")),
                        help="where the `istio-cni` plugin executable is written (default /opt/cni/bin; '' skips)")
    parser.add_argument("--chained-cni-plugin", type=parse_bool, default=env_default("CHAINED_CNI_PLUGIN", "true", parse_bool),
                        help="chain the plugin into the CNI config (default true; false leaves the config alone)")
    parser.add_argument("--netns-dir", type=Path, default=Path("/var/run/netns"),
                        help="where pods' network namespaces are found by IP when the plugin did not name them "
                             "(default /var/run/netns)")
    parser.add_argument("--ambient-dns-capture", type=parse_bool, default=env_default("AMBIENT_DNS_CAPTURE", "true", parse_bool),
                        help="redirect pods' DNS to ztunnel's 15053 (default true)")
    parser.add_argument("--exclude-namespaces", default=env("EXCLUDE_NAMESPACES", "kube-system"),
                        help="namespaces the plugin never hands to the agent, comma-separated (default kube-system)")
    parser.add_argument("--zds-ack-timeout", type=parse_duration, default=5.0,
                        help="how long ztunnel may take to ack a ZDS message before it is disconnected (default 5s)")
    parser.add_argument("--resync", type=parse_duration, default=5.0,
                        help="how often pods that could not be captured are tried again (default 5s)")


def cni_settings_from_args(args: argparse.Namespace) -> CniSettings:
    if not args.node_name:
        raise SystemExit("istiod cni: --node-name (or $NODE_NAME) is required")
    if args.config_dir is not None and not args.config_dir.is_dir():
        raise SystemExit(f"istiod cni: --config-dir {args.config_dir}: no such directory")
    kubeconfig = args.kubeconfig
    if args.config_dir is None and kubeconfig is None and os.environ.get("KUBECONFIG"):
        kubeconfig = Path(os.environ["KUBECONFIG"])
    return CniSettings(
        node_name=args.node_name,
        config_dir=args.config_dir,
        kubeconfig=kubeconfig,
        ztunnel_socket=args.ztunnel_uds_address,
        run_dir=args.cni_agent_run_dir,
        conf_dir=args.mounted_cni_net_dir,
        conf_name=args.cni_conf_name,
        bin_dir=args.cni_bin_dir if str(args.cni_bin_dir) not in ("", ".") else None,
        chained=args.chained_cni_plugin,
        netns_dir=args.netns_dir,
        dns_capture=args.ambient_dns_capture,
        exclude_namespaces=tuple(n.strip() for n in args.exclude_namespaces.split(",") if n.strip()),
        ack_timeout=args.zds_ack_timeout,
        resync=args.resync,
        log_level=args.log_level,
    )

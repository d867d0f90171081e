"""The CA's flags (with Istio's environment variables as defaults) -> one frozen CaSettings."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from istiod.ca.signer import TtlPolicy
from istiod.durations import parse_duration
from istiod.envvars import env_default
from istiod.model.names import parse_account

NODE_ACCOUNTS_VARIABLE = "CA_TRUSTED_NODE_ACCOUNTS"
DEFAULT_NODE_ACCOUNTS = "istio-system/ztunnel"


@dataclass(frozen=True, slots=True)
class RootPolicy:
    """istiod's CITADEL_SELF_SIGNED_CA_CERT_TTL, ..._ROOT_CERT_CHECK_INTERVAL, ..._GRACE_PERIOD_PERCENTILE."""

    ttl: timedelta = timedelta(days=3650)
    check_interval: float = 3600.0
    grace_percent: int = 20


@dataclass(frozen=True, slots=True)
class CaSettings:
    state_dir: Path = Path("state")
    plugged_dir: Path | None = None
    ttl: TtlPolicy = TtlPolicy()
    static_tokens: Path | None = None
    extra_sans: tuple[str, ...] = ()
    reload_interval: float = 1.0  # how often a plugged-in CA's files are checked
    root: RootPolicy = RootPolicy()  # the self-signed root's lifetime and rotation
    # Who may ask for certificates of the workloads on its node (ztunnel), as (namespace, service account).
    trusted_node_accounts: tuple[tuple[str, str], ...] = (("istio-system", "ztunnel"),)


def parse_node_accounts(text: str) -> tuple[tuple[str, str], ...]:
    """`namespace/serviceaccount,...`, as Istio's CA_TRUSTED_NODE_ACCOUNTS; empty: nobody."""
    try:
        return tuple(parse_account(entry.strip()) for entry in text.split(",") if entry.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_ca_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--ca-state-dir", type=Path, default=Path(env("CA_STATE_DIR", "state")),
                        help="config-dir mode: where the self-signed root persists (default ./state, under the directory"
                             " istiod starts in);"
                             " against a cluster it is the Secret istio-ca-secret")
    parser.add_argument("--plugged-ca-dir", type=Path,
                        help="use the CA in this directory (ca-cert.pem, ca-key.pem, cert-chain.pem, root-cert.pem),"
                             " reloaded when the files change")
    parser.add_argument("--workload-cert-ttl", type=parse_duration,
                        default=env_default("DEFAULT_WORKLOAD_CERT_TTL", "24h", parse_duration),
                        help="lifetime of a workload certificate when the request names none (default 24h)")
    parser.add_argument("--max-workload-cert-ttl", type=parse_duration,
                        default=env_default("MAX_WORKLOAD_CERT_TTL", "2160h", parse_duration),
                        help="longest lifetime a request may ask for (default 2160h, 90 days)")
    parser.add_argument("--ca-static-tokens", type=Path,
                        help="config-dir mode: a STAND-IN for Kubernetes TokenReview, a JSON file mapping"
                             " each token to 'namespace/serviceaccount'")
    # String defaults: argparse converts them with `type`, so a bad variable is an error naming the flag.
    root = RootPolicy()
    parser.add_argument("--self-signed-ca-cert-ttl", type=parse_duration,
                        default=env("CITADEL_SELF_SIGNED_CA_CERT_TTL", f"{root.ttl.days * 24}h"),
                        help="lifetime of a self-signed root, the first and each rotated one (default 87600h, 10 years)")
    parser.add_argument("--self-signed-root-cert-check-interval", type=parse_duration,
                        default=env("CITADEL_SELF_SIGNED_ROOT_CERT_CHECK_INTERVAL", "1h"),
                        help="how often the self-signed root is checked for rotation (default 1h)")
    parser.add_argument("--self-signed-root-cert-grace-period-percentile", type=int,
                        default=env("CITADEL_SELF_SIGNED_ROOT_CERT_GRACE_PERIOD_PERCENTILE", str(root.grace_percent)),
                        help="rotate the self-signed root when less than this percent of its lifetime is left (default 20)")
    parser.add_argument("--ca-trusted-node-accounts", type=parse_node_accounts,
                        default=env_default(NODE_ACCOUNTS_VARIABLE, DEFAULT_NODE_ACCOUNTS, parse_node_accounts),
                        help="node agents (ztunnel) that may ask for certificates of the workloads on their own node,"
                             " 'namespace/serviceaccount,...'; empty: none (default istio-system/ztunnel)")
    parser.add_argument("--tls-extra-san", action="append",
                        default=[h for h in env("ISTIOD_CUSTOM_HOST", "").split(",") if h],
                        help="another DNS name or IP for istiod's serving certificate (repeatable)")


def ca_settings_from_args(args: argparse.Namespace) -> CaSettings:
    ttl = TtlPolicy(timedelta(seconds=args.workload_cert_ttl), timedelta(seconds=args.max_workload_cert_ttl))
    if ttl.default > ttl.max:
        raise SystemExit("istiod discovery: --workload-cert-ttl is longer than --max-workload-cert-ttl")
    if args.ca_static_tokens is not None and args.config_dir is None:
        raise SystemExit("istiod discovery: --ca-static-tokens is for --config-dir only; a cluster's tokens are checked"
                         " with TokenReview")
    if not 0 < args.self_signed_root_cert_grace_period_percentile < 100:
        raise SystemExit("istiod discovery: --self-signed-root-cert-grace-period-percentile must be between 1 and 99")
    return CaSettings(
        state_dir=args.ca_state_dir,
        plugged_dir=args.plugged_ca_dir,
        ttl=ttl,
        static_tokens=args.ca_static_tokens,
        extra_sans=tuple(args.tls_extra_san),
        trusted_node_accounts=args.ca_trusted_node_accounts,
        root=RootPolicy(timedelta(seconds=args.self_signed_ca_cert_ttl), args.self_signed_root_cert_check_interval,
                        args.self_signed_root_cert_grace_period_percentile),
    )

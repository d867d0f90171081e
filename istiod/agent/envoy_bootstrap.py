"""The Envoy bootstrap Istio's agent writes for a sidecar (pure: settings in, JSON document out).

Envoy reaches istiod only through the agent: ADS over the `xds-grpc` cluster to the agent's xDS
proxy, and certificates over the `sds-grpc` cluster to the agent's SDS server, both on Unix sockets
whose paths are relative to Envoy's working directory, as in Istio's bootstrap. Both clusters must
speak HTTP/2 (gRPC), or Envoy connects to nothing and says nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from istiod.agent.bootstrap import NodeInfo
from istiod.model.config.common import RE2_MAX_PROGRAM_SIZE

XDS_SOCKET = "./etc/istio/proxy/XDS"
SDS_SOCKET = "./var/run/secrets/workload-spiffe-uds/socket"
XDS_CLUSTER = "xds-grpc"
SDS_CLUSTER = "sds-grpc"
PROMETHEUS_CLUSTER = "prometheus_stats"
# Istio's required stats inclusions (pkg/bootstrap's requiredEnvoyStatsMatcherInclusion*).
STATS_PREFIXES = ("cluster_manager", "listener_manager", "server", "cluster.xds-grpc", "wasm")
STATS_SUFFIXES = ("rbac.allowed", "rbac.denied", "shadow_allowed", "shadow_denied", "downstream_cx_active")
STATS_REGEXPS = (r"vhost\..*\.route\..*",)
META_PREFIX = "ISTIO_META_"
META_JSON_PREFIX = "ISTIO_METAJSON_"
# Istio's runtime values where upstream Envoy's defaults refuse valid config or serve it differently
# (pkg/bootstrap's extractRuntimeFlags). The others Istio sets change nothing in Envoy 1.40: the
# deprecated use_original_dst field is gone, and a global connection limit of 2^31-1 only trades
# Envoy's "no limit" warning for a deprecation one.
RUNTIME = {
    "re2.max_program_size.error_level": RE2_MAX_PROGRAM_SIZE,  # the limit validation holds regexes to
    "envoy.reloadable_features.http_reject_path_with_fragment": False,  # strip a #fragment, not a 400
}


def node_metadata(node: NodeInfo, environ: Mapping[str, str]) -> dict[str, Any]:
    """Istio's node metadata: the pod's own values, then every ISTIO_META_<KEY> (a string) and
    ISTIO_METAJSON_<KEY> (a JSON value) from the environment, which may override them, but for
    ISTIO_METAJSON_LABELS: STATIC_LABELS, merged under the pod's labels."""
    metadata: dict[str, Any] = {
        "NAME": node.pod,
        "NAMESPACE": node.namespace,
        "SERVICE_ACCOUNT": node.service_account,
        "INSTANCE_IPS": node.ip,
        "CLUSTER_ID": node.cluster_id,
        "WORKLOAD_NAME": node.workload_name or node.pod,
        "LABELS": dict(node.labels),
    }
    for name, value in sorted(environ.items()):
        if name.startswith(META_JSON_PREFIX):
            try:
                metadata[name.removeprefix(META_JSON_PREFIX)] = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"{name} is not JSON: {error}") from None
        elif name.startswith(META_PREFIX):
            metadata[name.removeprefix(META_PREFIX)] = value
    if isinstance(static := metadata.get("LABELS"), dict) and f"{META_JSON_PREFIX}LABELS" in environ:
        # pilot-agent's: labels set for the proxy stay beside its pod's (istiod keeps them when it
        # takes the pod's labels from the registry).
        metadata["STATIC_LABELS"] = static
        metadata["LABELS"] = {**static, **dict(node.labels)}
    return metadata


def _static_cluster(name: str, address: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": dict(address)}}]}],
        },
    }


def _grpc_cluster(name: str, socket_path: str) -> dict[str, Any]:
    return {
        **_static_cluster(name, {"pipe": {"path": socket_path}}),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }


def _prometheus_listener(host: str, port: int) -> dict[str, Any]:
    """Istio's 15090: Envoy's /stats/prometheus from its admin, and nothing else of the admin API."""
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "codec_type": "AUTO",
        "stat_prefix": "stats",
        "route_config": {"virtual_hosts": [{"name": "backend", "domains": ["*"], "routes": [
            {"match": {"prefix": "/stats/prometheus"}, "route": {"cluster": PROMETHEUS_CLUSTER}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    return {
        "address": {"socket_address": {"protocol": "TCP", "address": host or "0.0.0.0", "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
    }


def layered_runtime() -> dict[str, Any]:
    """Istio's layers: its static values, then an admin layer (so /runtime_modify works, as in Istio's)."""
    return {"layers": [{"name": "global config", "static_layer": dict(RUNTIME)}, {"name": "admin", "admin_layer": {}}]}


def stats_config(matcher: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """proxyStatsMatcher as Istio's bootstrap renders it: the stats it names, and those the agent and
    Istio's dashboards need (Istio's required inclusions), the rest not kept."""
    patterns: list[dict[str, Any]] = [{"prefix": p} for p in (*STATS_PREFIXES, *matcher.get("inclusionPrefixes", ()))]
    patterns += [{"suffix": s} for s in (*STATS_SUFFIXES, *matcher.get("inclusionSuffixes", ()))]
    patterns += [{"safe_regex": {"regex": r}} for r in (*STATS_REGEXPS, *matcher.get("inclusionRegexps", ()))]
    return {"stats_matcher": {"inclusion_list": {"patterns": patterns}}}


def envoy_bootstrap(node: NodeInfo, metadata: Mapping[str, Any], admin: Mapping[str, Any],
                    prometheus: tuple[str, int],
                    stats_matcher: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """`admin`: the admin address as the bootstrap spells it (EnvoyAdmin.bootstrap_address());
    `prometheus`: where Envoy serves its stats (Istio's :15090); `stats_matcher`: ProxyConfig's
    proxyStatsMatcher (None: every stat kept)."""
    ads = {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"}
    return {
        **({"stats_config": stats_config(stats_matcher)} if stats_matcher is not None else {}),
        "node": {
            "id": node.node_id,
            "cluster": f"{node.workload_name or node.pod}.{node.namespace}",
            "locality": {},
            "metadata": dict(metadata),
        },
        "layered_runtime": layered_runtime(),
        # Internal listeners (a waypoint's chain of listeners), as Istio's bootstrap always enables them.
        "bootstrap_extensions": [{"name": "envoy.bootstrap.internal_listener", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"}}],
        "admin": {"address": dict(admin)},
        "dynamic_resources": {
            "lds_config": ads,
            "cds_config": ads,
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
            },
        },
        "static_resources": {
            "clusters": [_grpc_cluster(XDS_CLUSTER, XDS_SOCKET), _grpc_cluster(SDS_CLUSTER, SDS_SOCKET),
                         _static_cluster(PROMETHEUS_CLUSTER, admin)],
            "listeners": [_prometheus_listener(*prometheus)],
        },
    }


def merge_override(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Istio's bootstrap override (ISTIO_BOOTSTRAP_OVERRIDE) merges like protobuf's MergeFrom:
    maps merge, lists append, other values replace."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = merge_override(merged[key], value)
        elif isinstance(value, list) and isinstance(merged.get(key), list):
            merged[key] = merged[key] + value
        else:
            merged[key] = value
    return merged

"""The Envoy bootstrap Istio's agent writes for a sidecar (pure: settings in, JSON document out).

Envoy reaches istiod only through the agent: ADS over the `xds-grpc` cluster to the agent's xDS
proxy, and certificates over the `sds-grpc` cluster to the agent's SDS server, both on Unix sockets
whose paths are relative to Envoy's working directory, as in Istio's bootstrap. Both clusters must
speak HTTP/2 (gRPC), or Envoy connects to nothing and says nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from istiod.agent.bootstrap import NodeInfo

XDS_SOCKET = "./etc/istio/proxy/XDS"
SDS_SOCKET = "./var/run/secrets/workload-spiffe-uds/socket"
XDS_CLUSTER = "xds-grpc"
SDS_CLUSTER = "sds-grpc"
META_PREFIX = "ISTIO_META_"
META_JSON_PREFIX = "ISTIO_METAJSON_"


def node_metadata(node: NodeInfo, environ: Mapping[str, str]) -> dict[str, Any]:
    """Istio's node metadata: the pod's own values, then every ISTIO_META_<KEY> (a string) and
    ISTIO_METAJSON_<KEY> (a JSON value) from the environment, which may override them."""
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
    return metadata


def _unix_grpc_cluster(name: str, path: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": path}}}}]}],
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }


def envoy_bootstrap(node: NodeInfo, metadata: Mapping[str, Any], admin: Mapping[str, Any]) -> dict[str, Any]:
    """`admin`: the admin address as the bootstrap spells it (EnvoyAdmin.bootstrap_address())."""
    ads = {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"}
    return {
        "node": {
            "id": node.node_id,
            "cluster": f"{node.workload_name or node.pod}.{node.namespace}",
            "locality": {},
            "metadata": dict(metadata),
        },
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
            "clusters": [_unix_grpc_cluster(XDS_CLUSTER, XDS_SOCKET), _unix_grpc_cluster(SDS_CLUSTER, SDS_SOCKET)],
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

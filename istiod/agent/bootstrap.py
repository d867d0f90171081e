"""The gRPC xDS bootstrap Istio's agent writes for proxyless gRPC workloads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from istiod.model.names import DEFAULT_DOMAIN, INBOUND_LISTENER_PREFIX


@dataclass(frozen=True, slots=True)
class NodeInfo:
    ip: str
    pod: str
    namespace: str
    service_account: str = "default"
    labels: dict[str, str] = field(default_factory=dict)
    workload_name: str = ""
    domain: str = DEFAULT_DOMAIN
    cluster_id: str = "Kubernetes"

    @property
    def node_id(self) -> str:
        return f"sidecar~{self.ip}~{self.pod}.{self.namespace}~{self.namespace}.svc.{self.domain}"


def bootstrap(xds_address: str, node: NodeInfo) -> dict[str, Any]:
    return {
        "xds_servers": [
            {"server_uri": xds_address, "channel_creds": [{"type": "insecure"}], "server_features": ["xds_v3"]}
        ],
        "node": {
            "id": node.node_id,
            "metadata": {
                "GENERATOR": "grpc",
                "NAMESPACE": node.namespace,
                "SERVICE_ACCOUNT": node.service_account,
                "LABELS": node.labels,
                "WORKLOAD_NAME": node.workload_name or node.pod,
                "CLUSTER_ID": node.cluster_id,
                "INSTANCE_IPS": node.ip,
            },
            "locality": {},
        },
        "server_listener_resource_name_template": f"{INBOUND_LISTENER_PREFIX}%s",
    }


def bootstrap_json(xds_address: str, node: NodeInfo) -> str:
    return json.dumps(bootstrap(xds_address, node), indent=2)

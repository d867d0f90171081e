"""The gRPC xDS bootstrap Istio's agent writes for proxyless gRPC workloads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from istiod.certfiles import CERT_CHAIN_FILE, KEY_FILE, PROVIDER_INSTANCE, ROOT_CERT_FILE
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
    proxy_type: str = "sidecar"  # or `router`: an ingress gateway (pilot-agent's `proxy router`)

    @property
    def node_id(self) -> str:
        return f"{self.proxy_type}~{self.ip}~{self.pod}.{self.namespace}~{self.namespace}.svc.{self.domain}"


@dataclass(frozen=True, slots=True)
class CertFiles:
    """Where the agent keeps the workload's certificate, key and the mesh root."""

    directory: Path
    refresh_interval: float = 900.0  # how often gRPC re-reads them

    @property
    def files(self) -> dict[str, str]:
        return {
            "certificate_file": str(self.directory / CERT_CHAIN_FILE),
            "private_key_file": str(self.directory / KEY_FILE),
            "ca_certificate_file": str(self.directory / ROOT_CERT_FILE),
        }


def bootstrap(xds_address: str, node: NodeInfo, certs: CertFiles | None = None) -> dict[str, Any]:
    """With `certs`, istiod is reached over mTLS and TLS contexts from xDS find the certificates
    through the `file_watcher` provider `default`; without, everything is plaintext."""
    creds: dict[str, Any] = {"type": "insecure"} if certs is None else {"type": "tls", "config": certs.files}
    document = {
        "xds_servers": [{"server_uri": xds_address, "channel_creds": [creds], "server_features": ["xds_v3"]}],
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
    if certs is not None:
        config = {**certs.files, "refresh_interval": f"{certs.refresh_interval:g}s"}
        document["certificate_providers"] = {PROVIDER_INSTANCE: {"plugin_name": "file_watcher", "config": config}}
    return document


def bootstrap_json(xds_address: str, node: NodeInfo, certs: CertFiles | None = None) -> str:
    return json.dumps(bootstrap(xds_address, node, certs), indent=2)

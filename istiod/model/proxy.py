"""Proxies: who is connected, parsed from the xDS node ID and metadata as Istio sends them."""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass
from typing import Any

from istiod.model.names import DEFAULT_DOMAIN
from istiod.model.service import Locality

NODE_TYPES = ("sidecar", "router", "waypoint", "ztunnel")


class NodeIdError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Proxy:
    id: str
    type: str
    ip_addresses: tuple[str, ...]
    pod_name: str
    namespace: str
    dns_domain: str
    generator: str = ""
    service_account: str = ""
    labels: tuple[tuple[str, str], ...] = ()  # its Pod's from the registry once resolved, else LABELS metadata
    static_labels: tuple[tuple[str, str], ...] = ()  # STATIC_LABELS metadata (ISTIO_METAJSON_LABELS)
    workload_name: str = ""
    cluster_id: str = ""
    istio_version: str = ""
    network: str = ""  # node metadata NETWORK (ISTIO_META_NETWORK)
    # REQUESTED_NETWORK_VIEW: the networks whose endpoints it is sent (and those without one); () all.
    network_view: tuple[str, ...] = ()
    # The caller proved it is this proxy's namespace and service account (istiod's secure port);
    # only such a proxy is sent its namespace's Secrets, as istiod's VerifiedIdentity.
    verified: bool = False
    verified_service_account: str = ""  # of the identity it proved, when verified
    locality: Locality = Locality()  # the node's (bootstrap's) locality; the registry's wins (xds/gen/locality.py)
    # WorkloadEntry auto-registration and health (istiod/autoregistration.py): the WorkloadGroup to
    # register with (AUTO_REGISTER_GROUP), or the existing entry it is (WORKLOAD_ENTRY); whether its
    # agent runs a readiness probe (PROXY_CONFIG's readinessProbe) and so reports health.
    auto_register_group: str = ""
    workload_entry: str = ""
    health_checked: bool = False

    @property
    def ip(self) -> str:
        return self.ip_addresses[0]

    @property
    def proxyless(self) -> bool:
        return self.generator == "grpc"

    @property
    def domain(self) -> str:
        """The cluster's DNS suffix, from `<ns>.svc.<domain>`."""
        prefix = f"{self.namespace}.svc."
        return self.dns_domain[len(prefix):] if self.dns_domain.startswith(prefix) else DEFAULT_DOMAIN


def parse_node_id(node_id: str) -> tuple[str, str, str, str, str]:
    """`type~ip~pod.namespace~domain` -> (type, ip, pod, namespace, domain); raises NodeIdError."""
    parts = node_id.split("~")
    if len(parts) != 4:
        raise NodeIdError(f"node ID {node_id!r} must have 4 '~'-separated parts, has {len(parts)}")
    node_type, ip, pod_dot_ns, domain = parts
    if node_type not in NODE_TYPES:
        raise NodeIdError(f"node ID {node_id!r}: unknown proxy type {node_type!r}")
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        raise NodeIdError(f"node ID {node_id!r}: {ip!r} is not an IP address") from None
    pod, dot, namespace = pod_dot_ns.partition(".")
    if not dot or not pod or not namespace:
        raise NodeIdError(f"node ID {node_id!r}: third part must be <pod>.<namespace>")
    return node_type, ip, pod, namespace, domain


def proxy_from_node(node_id: str, metadata: dict[str, Any], locality: Locality = Locality()) -> Proxy:
    """Build a Proxy from the node ID and its metadata (a plain dict of the node's Struct)."""
    node_type, ip, pod, id_namespace, domain = parse_node_id(node_id)
    namespace = str(metadata.get("NAMESPACE") or id_namespace)
    extra_ips = [s for s in str(metadata.get("INSTANCE_IPS", "")).split(",") if s and s != ip]
    labels, static = metadata.get("LABELS") or {}, metadata.get("STATIC_LABELS") or {}
    for key, value in (("LABELS", labels), ("STATIC_LABELS", static)):
        if not isinstance(value, dict):
            raise NodeIdError(f"node {node_id!r}: {key} metadata must be a map")
    return Proxy(
        id=node_id,
        type=node_type,
        ip_addresses=(ip, *extra_ips),
        pod_name=pod,
        namespace=namespace,
        dns_domain=domain,
        generator=str(metadata.get("GENERATOR", "")),
        service_account=str(metadata.get("SERVICE_ACCOUNT", "")),
        labels=_label_tuple(labels),
        static_labels=_label_tuple(static),
        workload_name=str(metadata.get("WORKLOAD_NAME", "")),
        cluster_id=str(metadata.get("CLUSTER_ID", "")),
        istio_version=str(metadata.get("ISTIO_VERSION", "")),
        network=str(metadata.get("NETWORK", "")),
        network_view=_string_list(metadata.get("REQUESTED_NETWORK_VIEW")),
        locality=locality,
        auto_register_group=str(metadata.get("AUTO_REGISTER_GROUP", "")),
        workload_entry=str(metadata.get("WORKLOAD_ENTRY", "")),
        health_checked=isinstance(proxy_config := metadata.get("PROXY_CONFIG"), dict)
        and bool(proxy_config.get("readinessProbe")),
    )


def _string_list(value: Any) -> tuple[str, ...]:
    """Istio's StringList metadata: a comma-separated string (or a list)."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else []
    return tuple(sorted({str(item).strip() for item in items} - {""}))


def _label_tuple(labels: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in labels.items()))


def with_workload_labels(node: Proxy, pod_labels: tuple[tuple[str, str], ...] | None) -> Proxy:
    """istiod's SetWorkloadLabels: the proxy's labels are its Pod's in the registry, over the
    STATIC_LABELS it sent, so relabelling a running pod re-selects its config; without a Pod (not
    yet seen, or not in Kubernetes) the LABELS it sent. `node` is the proxy as it connected."""
    if pod_labels is None:
        return node
    return dataclasses.replace(node, labels=tuple(sorted({**dict(node.static_labels), **dict(pod_labels)}.items())))

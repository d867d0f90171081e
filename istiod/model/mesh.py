"""Mesh-wide settings the generators read: the parts of Istio's MeshConfig istiod implements."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from istiod.model.names import DEFAULT_DOMAIN

DEFAULT_TRUST_DOMAIN = DEFAULT_DOMAIN  # istiod's default trust domain is cluster.local too
DEFAULT_ROOT_NAMESPACE = "istio-system"


class OutboundTrafficPolicy(enum.Enum):
    ALLOW_ANY = "ALLOW_ANY"
    REGISTRY_ONLY = "REGISTRY_ONLY"


@dataclass(frozen=True, slots=True)
class LabelRequirement:
    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "In":
            return labels.get(self.key) in self.values
        if self.operator == "NotIn":
            return labels.get(self.key) not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A Kubernetes LabelSelector (matchLabels and matchExpressions), as discoverySelectors hold them."""

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[LabelRequirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels) and all(
            r.matches(labels) for r in self.match_expressions)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """defaultConfig: what proxies get unless their own annotation says otherwise."""

    discovery_address: str = "istiod.istio-system.svc:15012"
    proxy_metadata: tuple[tuple[str, str], ...] = ()
    hold_application_until_proxy_starts: bool = False


@dataclass(frozen=True, slots=True)
class MeshConfig:
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    # Mesh-wide mTLS between proxyless gRPC workloads (STRICT); PeerAuthentication and
    # DestinationRule will refine it per workload and service.
    mtls: bool = False
    root_namespace: str = DEFAULT_ROOT_NAMESPACE
    outbound_traffic_policy: OutboundTrafficPolicy = OutboundTrafficPolicy.ALLOW_ANY
    enable_auto_mtls: bool = True
    default_config: ProxyConfig = ProxyConfig()
    discovery_selectors: tuple[LabelSelector, ...] = ()  # none: every namespace

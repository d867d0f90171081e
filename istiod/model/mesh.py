"""Mesh-wide settings the generators read (the parts of Istio's MeshConfig used so far)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from istiod.model.names import DEFAULT_DOMAIN

DEFAULT_TRUST_DOMAIN = DEFAULT_DOMAIN  # istiod's default trust domain is cluster.local too


class OutboundTrafficPolicy(enum.Enum):
    ALLOW_ANY = "ALLOW_ANY"
    REGISTRY_ONLY = "REGISTRY_ONLY"


@dataclass(frozen=True, slots=True)
class MeshConfig:
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    # Mesh-wide mTLS between proxyless gRPC workloads (STRICT); PeerAuthentication and
    # DestinationRule will refine it per workload and service.
    mtls: bool = False
    # outboundTrafficPolicy.mode: where a sidecar sends traffic for hosts outside the registry.
    outbound_traffic_policy: OutboundTrafficPolicy = OutboundTrafficPolicy.ALLOW_ANY

"""Istio's config kinds: API group, versions, names. One table for the CRDs, informers, RBAC and the webhook."""

from __future__ import annotations

from dataclasses import dataclass

NETWORKING = "networking.istio.io"
SECURITY = "security.istio.io"


@dataclass(frozen=True, slots=True)
class ConfigKind:
    kind: str
    group: str
    versions: tuple[str, ...]  # every served version
    storage: str  # the version etcd keeps (Istio's: v1alpha3 for networking, v1beta1 for security)
    plural: str
    short_names: tuple[str, ...]

    @property
    def resource(self) -> str:
        """`<plural>.<group>`, the CRD's name."""
        return f"{self.plural}.{self.group}"


_NETWORKING_VERSIONS = ("v1alpha3", "v1beta1", "v1")
_SECURITY_VERSIONS = ("v1beta1", "v1")

CONFIG_KINDS: tuple[ConfigKind, ...] = (
    ConfigKind("VirtualService", NETWORKING, _NETWORKING_VERSIONS, "v1alpha3", "virtualservices", ("vs",)),
    ConfigKind("DestinationRule", NETWORKING, _NETWORKING_VERSIONS, "v1alpha3", "destinationrules", ("dr",)),
    ConfigKind("ServiceEntry", NETWORKING, _NETWORKING_VERSIONS, "v1alpha3", "serviceentries", ("se",)),
    ConfigKind("Gateway", NETWORKING, _NETWORKING_VERSIONS, "v1alpha3", "gateways", ("gw",)),
    ConfigKind("Sidecar", NETWORKING, _NETWORKING_VERSIONS, "v1alpha3", "sidecars", ()),
    ConfigKind("WorkloadEntry", NETWORKING, _NETWORKING_VERSIONS, "v1alpha3", "workloadentries", ("we",)),
    ConfigKind("PeerAuthentication", SECURITY, _SECURITY_VERSIONS, "v1beta1", "peerauthentications", ("pa",)),
    ConfigKind("AuthorizationPolicy", SECURITY, _SECURITY_VERSIONS, "v1beta1", "authorizationpolicies", ("ap",)),
    ConfigKind("RequestAuthentication", SECURITY, _SECURITY_VERSIONS, "v1beta1", "requestauthentications", ("ra",)),
)
BY_KIND: dict[str, ConfigKind] = {k.kind: k for k in CONFIG_KINDS}

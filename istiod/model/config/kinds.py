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
    ConfigKind("WorkloadGroup", NETWORKING, _NETWORKING_VERSIONS, "v1alpha3", "workloadgroups", ("wg",)),
    ConfigKind("PeerAuthentication", SECURITY, _SECURITY_VERSIONS, "v1beta1", "peerauthentications", ("pa",)),
    ConfigKind("AuthorizationPolicy", SECURITY, _SECURITY_VERSIONS, "v1beta1", "authorizationpolicies", ("ap",)),
    ConfigKind("RequestAuthentication", SECURITY, _SECURITY_VERSIONS, "v1beta1", "requestauthentications", ("ra",)),
    ConfigKind("ProxyConfig", NETWORKING, ("v1beta1",), "v1beta1", "proxyconfigs", ()),
    ConfigKind("EnvoyFilter", NETWORKING, ("v1alpha3",), "v1alpha3", "envoyfilters", ()),
)
BY_KIND: dict[str, ConfigKind] = {k.kind: k for k in CONFIG_KINDS}

# Istio's kinds this istiod does not implement. A cluster moving from Istio's istiod has their CRDs and
# may have objects: those are read only to say, once per object, that they have no effect here, and
# the webhook lets them in with a warning saying the same (`storage` is the version they are read at).
UNIMPLEMENTED_KINDS: tuple[ConfigKind, ...] = (
    ConfigKind("Telemetry", "telemetry.istio.io", ("v1alpha1", "v1"), "v1alpha1", "telemetries", ("telemetry",)),
    ConfigKind("WasmPlugin", "extensions.istio.io", ("v1alpha1",), "v1alpha1", "wasmplugins", ()),
)
UNIMPLEMENTED_BY_KIND: dict[str, ConfigKind] = {k.kind: k for k in UNIMPLEMENTED_KINDS}


def unimplemented(kind: str, api_version: str) -> str | None:
    """What to tell of an object of Istio's that this istiod does not implement, else None."""
    known = UNIMPLEMENTED_BY_KIND.get(kind)
    if known is None or api_version.partition("/")[0] != known.group:
        return None
    return f"{kind} is not implemented by this istiod: the object is kept but has no effect on any proxy"

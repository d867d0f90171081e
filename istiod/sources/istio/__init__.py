"""Istio's config kinds read from the same sources as Services (config dir, informers), validated on the way in."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from istiod.model.config.kinds import BY_KIND
from istiod.sources.fields import ConversionError, ObjectKey, _Fields
from istiod.sources.istio import networking, security
from istiod.sources.istio.envoyfilter import envoy_filter
from istiod.sources.istio.proxy_config import proxy_config

CONVERTERS: dict[str, Callable[[ObjectKey, _Fields, str], Any]] = {
    "VirtualService": networking.virtual_service,
    "DestinationRule": networking.destination_rule,
    "ServiceEntry": networking.service_entry,
    "Gateway": networking.gateway,
    "Sidecar": networking.sidecar,
    "WorkloadEntry": networking.workload_entry,
    "WorkloadGroup": networking.workload_group,
    "PeerAuthentication": security.peer_authentication,
    "AuthorizationPolicy": security.authorization_policy,
    "RequestAuthentication": security.request_authentication,
    "ProxyConfig": proxy_config,
    "EnvoyFilter": envoy_filter,
}


def istio_converter(key: ObjectKey, body: Mapping[str, Any]) -> Callable[[ObjectKey, _Fields, str], Any] | None:
    """The converter of an Istio kind; None for any other kind. An object of another API group
    with an Istio kind's name is refused (the Gateway API's Gateway is read as KubernetesGateway)."""
    kind = BY_KIND.get(key.kind)
    if kind is None:
        return None
    api_version = body.get("apiVersion")
    if api_version is not None:  # informers' list items may lack it; the informer knows the kind
        group, _, version = str(api_version).rpartition("/")
        if group != kind.group:
            raise ConversionError(f"{key}: apiVersion {api_version!r}: only {kind.group}'s {key.kind} is read")
        if version not in kind.versions:
            raise ConversionError(f"{key}: apiVersion {api_version!r}: {kind.group} serves {', '.join(kind.versions)}")
    return CONVERTERS[key.kind]

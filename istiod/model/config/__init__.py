"""Istio's configuration as typed, immutable values, and the rules that scope it to proxies."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from istiod.model.config.networking import (
    DestinationRule, Gateway, ServiceEntry, Sidecar, VirtualService, WorkloadEntry,
)
from istiod.model.config.security import AuthorizationPolicy, PeerAuthentication, RequestAuthentication


class _Values(Protocol):
    def values(self, kind: str) -> Iterable[Any]: ...


def _sorted(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(sorted(values, key=lambda v: (v.meta.namespace, v.meta.name)))


@dataclass(frozen=True, slots=True)
class ConfigSet:
    """Every Istio config object of one snapshot, each kind ordered by namespace and name."""

    virtual_services: tuple[VirtualService, ...] = ()
    destination_rules: tuple[DestinationRule, ...] = ()
    service_entries: tuple[ServiceEntry, ...] = ()
    gateways: tuple[Gateway, ...] = ()
    sidecars: tuple[Sidecar, ...] = ()
    workload_entries: tuple[WorkloadEntry, ...] = ()
    peer_authentications: tuple[PeerAuthentication, ...] = ()
    authorization_policies: tuple[AuthorizationPolicy, ...] = ()
    request_authentications: tuple[RequestAuthentication, ...] = ()

    @classmethod
    def collect(cls, objects: _Values) -> ConfigSet:
        return cls(*(_sorted(objects.values(kind)) for kind in (
            "VirtualService", "DestinationRule", "ServiceEntry", "Gateway", "Sidecar", "WorkloadEntry",
            "PeerAuthentication", "AuthorizationPolicy", "RequestAuthentication")))

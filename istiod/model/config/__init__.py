"""Istio's configuration as typed, immutable values, and the rules that scope it to proxies."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from istiod.model.config import scope
from istiod.model.config.backend_tls import with_backend_policies
from istiod.model.config.delegate import merge_delegates
from istiod.model.config.envoyfilter import EnvoyFilter
from istiod.model.config.gateway_api import (
    BackendTLSPolicy, BackendTrafficPolicy, ConfigMap, GatewayApiConfig, GatewayClass, KubernetesGateway, KubernetesHTTPRoute, ReferenceGrant,
)
from istiod.model.config.networking import (
    MESH_GATEWAY, DestinationRule, Gateway, ServiceEntry, Sidecar, VirtualService, WorkloadEntry, WorkloadGroup,
)
from istiod.model.config.security import AuthorizationPolicy, PeerAuthentication, RequestAuthentication


class _Values(Protocol):
    def values(self, kind: str) -> Iterable[Any]: ...


def _sorted(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(sorted(values, key=lambda v: (v.meta.namespace, v.meta.name)))


def _by_namespace(items: Iterable[Any]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = defaultdict(list)
    for item in items:
        grouped[item.meta.namespace].append(item)
    return grouped


@dataclass(frozen=True, slots=True)
class ConfigSet:
    """Every Istio config object of one snapshot, each kind ordered by namespace and name, with
    the lookups of `scope` over indexes built on first use (a push asks them per proxy and host)."""

    virtual_services: tuple[VirtualService, ...] = ()
    destination_rules: tuple[DestinationRule, ...] = ()
    service_entries: tuple[ServiceEntry, ...] = ()
    gateways: tuple[Gateway, ...] = ()
    sidecars: tuple[Sidecar, ...] = ()
    workload_entries: tuple[WorkloadEntry, ...] = ()
    workload_groups: tuple[WorkloadGroup, ...] = ()
    peer_authentications: tuple[PeerAuthentication, ...] = ()
    authorization_policies: tuple[AuthorizationPolicy, ...] = ()
    request_authentications: tuple[RequestAuthentication, ...] = ()
    envoy_filters: tuple[EnvoyFilter, ...] = ()
    gateway_classes: tuple[GatewayClass, ...] = ()
    kubernetes_gateways: tuple[KubernetesGateway, ...] = ()
    http_routes: tuple[KubernetesHTTPRoute, ...] = ()
    grpc_routes: tuple[KubernetesHTTPRoute, ...] = ()
    tcp_routes: tuple[KubernetesHTTPRoute, ...] = ()
    tls_routes: tuple[KubernetesHTTPRoute, ...] = ()
    reference_grants: tuple[ReferenceGrant, ...] = ()
    backend_tls_policies: tuple[BackendTLSPolicy, ...] = ()
    backend_traffic_policies: tuple[BackendTrafficPolicy, ...] = ()  # XBackendTrafficPolicy
    config_maps: tuple[ConfigMap, ...] = ()  # Gateways' parameters, BackendTLSPolicies' CAs
    # What the Gateway API objects above make (the model builder converts them, with Services and
    # Secrets): carried over until the builder converts again.
    gateway_api: GatewayApiConfig = GatewayApiConfig()
    # The mesh's exportTo of VirtualServices and DestinationRules that set none, read by every lookup.
    export_defaults: scope.ExportToDefaults = scope.ExportToDefaults()
    _index: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def collect(cls, objects: _Values, previous: ConfigSet | None = None, changed: Collection[str] = (),
                export_defaults: scope.ExportToDefaults = scope.ExportToDefaults()) -> ConfigSet:
        """Every kind from `objects`; with `previous`, only the `changed` kinds (the others and, when
        none changed, the whole set with its indexes are carried over). Other `export_defaults`
        than the previous set's merge the delegates again (their visibility changed)."""
        if previous is not None and previous.export_defaults != export_defaults:
            changed = {*changed, "VirtualService"}
        if previous is not None and not any(kind in changed for kind in _FIELDS):
            return previous
        fields: dict[str, Any] = {
            name: getattr(previous, name) if previous is not None and kind not in changed else _sorted(objects.values(kind))
            for kind, name in _FIELDS.items()
        }
        if previous is None or "VirtualService" in changed:  # roots take their delegates' routes
            fields["virtual_services"] = merge_delegates(fields["virtual_services"], export_defaults)
        return cls(**fields, gateway_api=previous.gateway_api if previous is not None else GatewayApiConfig(),
                   export_defaults=export_defaults)

    @property
    def has_gateway_api(self) -> bool:
        return any(getattr(self, name) for kind, name in _FIELDS.items() if kind in GATEWAY_API_KINDS)

    def with_gateway_api(self, converted: GatewayApiConfig) -> ConfigSet:
        """This set with `converted` in place of its Gateway API conversion (itself when equal)."""
        if converted == self.gateway_api:
            return self
        return replace(self, gateway_api=converted, _index={})

    @property
    def all_virtual_services(self) -> tuple[VirtualService, ...]:
        """The VirtualServices and those the Gateway API's routes make (bound to their Gateways, or
        to `mesh` for a Service parent)."""
        derived = self.gateway_api.virtual_services + self.gateway_api.mesh_virtual_services
        return self.virtual_services + derived if derived else self.virtual_services

    def kinds_changed_from(self, previous: ConfigSet) -> set[str]:
        """The kinds whose objects differ from `previous`'s (unchanged kinds are carried over: identity first)."""
        if previous is self:
            return set()
        kinds = {kind for kind, name in _FIELDS.items()
                 if (old := getattr(previous, name)) is not (new := getattr(self, name)) and old != new}
        before, after = previous.gateway_api, self.gateway_api
        if before is not after:  # what the gateway flavor reads of the conversion
            if before.gateways != after.gateways:
                kinds.add("Gateway")
            if (before.virtual_services != after.virtual_services
                    or before.mesh_virtual_services != after.mesh_virtual_services):
                kinds.add("VirtualService")
            if before.destination_rules != after.destination_rules:
                kinds.add("DestinationRule")
        return kinds

    def _grouped(self, name: str) -> Mapping[str, list[Any]]:
        if name not in self._index:
            self._index[name] = _by_namespace(getattr(self, name))
        return self._index[name]

    def _in(self, name: str, *namespaces: str) -> list[Any]:
        grouped = self._grouped(name)
        return [item for ns in dict.fromkeys(namespaces) for item in grouped.get(ns, ())]

    @property
    def all_destination_rules(self) -> tuple[DestinationRule, ...]:
        """The DestinationRules with those BackendTLSPolicies make merged in (backend_tls.py)."""
        if not self.gateway_api.destination_rules:
            return self.destination_rules
        if "merged_destination_rules" not in self._index:  # (_grouped keeps its index by the property's name)
            self._index["merged_destination_rules"] = with_backend_policies(self.destination_rules,
                                                                             self.gateway_api.destination_rules)
        return self._index["merged_destination_rules"]  # type: ignore[no-any-return]

    def destination_rule_for(self, proxy_namespace: str, proxy_labels: Mapping[str, str], host: str,
                             service_namespace: str, root_namespace: str) -> DestinationRule | None:
        grouped = self._grouped("all_destination_rules")
        # Asked per cluster, per proxy, per push, and most namespaces have none: no list, no walk.
        if not (proxy_namespace in grouped or service_namespace in grouped or root_namespace in grouped):
            return None
        rules = self._in("all_destination_rules", proxy_namespace, service_namespace, root_namespace)
        return scope.destination_rule_for(rules, proxy_namespace, proxy_labels, host, service_namespace, root_namespace,
                                          self.export_defaults)

    def virtual_service_for_host(self, namespace: str, host: str, gateway: str = MESH_GATEWAY) -> VirtualService | None:
        """The VirtualService for a host; for `mesh`, as istiod orders them (SelectVirtualServices):
        one exported to the proxy's namespace by name (exportTo `.` or the namespace) first, then a
        route on the Service (GAMMA), then the others."""
        found = self._virtual_service_for_host(namespace, host, gateway)
        if gateway != MESH_GATEWAY or not self.gateway_api.mesh_virtual_services:
            return found
        if found is not None and (export_to := self.export_defaults.of_virtual_service(found)) and "*" not in export_to:
            return found
        if "mesh_routes" not in self._index:
            self._index["mesh_routes"] = {(vs.meta.namespace, vs.hosts[0]): vs
                                          for vs in self.gateway_api.mesh_virtual_services}
        return scope.mesh_route_for_host(self._index["mesh_routes"], namespace, host) or found

    def _virtual_service_for_host(self, namespace: str, host: str, gateway: str) -> VirtualService | None:
        if "vs_hosts" not in self._index:
            exact: dict[str, list[VirtualService]] = defaultdict(list)
            wildcard: list[VirtualService] = []
            for vs in self.virtual_services:
                for h in vs.hosts:
                    (wildcard if h.startswith("*") else exact[h]).append(vs)
            self._index["vs_hosts"] = (exact, wildcard)
        exact, wildcard = self._index["vs_hosts"]
        candidates = list(dict.fromkeys(exact.get(host, []) + wildcard))
        return scope.virtual_service_for_host(candidates, namespace, host, gateway, self.export_defaults)

    def selector_keys(self) -> frozenset[str]:
        """Every label key some object selects workloads by (workload selectors, VirtualService
        source labels): proxies whose labels agree on these are selected alike by all of them."""
        if "selector_keys" not in self._index:
            selectors = [
                *(r.workload_selector for r in self.all_destination_rules), *(s.workload_selector for s in self.sidecars),
                *(e.workload_selector for e in self.service_entries), *(g.selector for g in self.gateways),
                *(m.source_labels for vs in self.virtual_services for route in vs.http for m in route.match),
                *(m.source_labels for vs in self.virtual_services for route in (*vs.tcp, *vs.tls) for m in route.match),
                *(p.selector for p in self.peer_authentications), *(p.selector for p in self.authorization_policies),
                *(p.selector for p in self.request_authentications), *(f.workload_selector for f in self.envoy_filters),
            ]
            self._index["selector_keys"] = frozenset(key for selector in selectors for key, _ in selector)
        return self._index["selector_keys"]  # type: ignore[no-any-return]

    def envoy_filters_for(self, namespace: str, labels: Mapping[str, str], root_namespace: str) -> list[EnvoyFilter]:
        if not self.envoy_filters:  # asked for every listener, route and cluster response
            return []
        return scope.envoy_filters_for(self._in("envoy_filters", namespace, root_namespace), namespace, labels,
                                       root_namespace)

    def sidecar_for(self, namespace: str, labels: Mapping[str, str], root_namespace: str) -> Sidecar | None:
        return scope.sidecar_for(self._in("sidecars", namespace, root_namespace), namespace, labels, root_namespace)


# Kind -> ConfigSet field, in the fields' order.
_FIELDS = {
    "VirtualService": "virtual_services", "DestinationRule": "destination_rules", "ServiceEntry": "service_entries",
    "Gateway": "gateways", "Sidecar": "sidecars", "WorkloadEntry": "workload_entries",
    "WorkloadGroup": "workload_groups", "PeerAuthentication": "peer_authentications", "AuthorizationPolicy": "authorization_policies",
    "RequestAuthentication": "request_authentications", "EnvoyFilter": "envoy_filters",
    "GatewayClass": "gateway_classes", "KubernetesGateway": "kubernetes_gateways", "HTTPRoute": "http_routes",
    "GRPCRoute": "grpc_routes", "TCPRoute": "tcp_routes", "TLSRoute": "tls_routes", "ReferenceGrant": "reference_grants",
    "BackendTLSPolicy": "backend_tls_policies", "XBackendTrafficPolicy": "backend_traffic_policies",
    "ConfigMap": "config_maps",
}
GATEWAY_API_KINDS = frozenset({"GatewayClass", "KubernetesGateway", "HTTPRoute", "GRPCRoute", "TCPRoute", "TLSRoute",
                               "ReferenceGrant", "BackendTLSPolicy", "XBackendTrafficPolicy"})

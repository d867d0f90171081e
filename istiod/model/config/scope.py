"""Which config applies where: istiod's scoping rules as pure functions over model values.

- exportTo: `.` the object's namespace, `*` every namespace, `~` none, else the named ones; empty
  means the mesh default (meshConfig's default*ExportTo, else every namespace).
- The root namespace (the mesh's rootNamespace) holds mesh-wide defaults.
- DestinationRule for (proxy namespace, host): the proxy's own namespace first, then the host's
  service namespace (exported rules), then the root namespace; within one, the most specific host.
- Sidecar for a proxy: one in its namespace whose workloadSelector matches, else its namespace's
  default (no selector), else the root namespace's default.
- PeerAuthentication, AuthorizationPolicy, RequestAuthentication: the root namespace's apply to
  every workload they select; a namespace's to its own workloads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from istiod.model.config.common import Labels, Meta, selector_matches
from istiod.model.config.envoyfilter import EnvoyFilter
from istiod.model.config.networking import (
    MESH_GATEWAY, DestinationRule, EgressListener, Gateway, ServiceEntry, Sidecar, VirtualService, WorkloadEntry,
)
from istiod.model.config.security import MTLSMode, PeerAuthentication


class _Scoped(Protocol):
    @property
    def meta(self) -> Meta: ...


S = TypeVar("S", bound=_Scoped)


def exported_to(export_to: Sequence[str], owner_namespace: str, namespace: str) -> bool:
    """Whether an object in `owner_namespace` with this exportTo is visible from `namespace`."""
    if not export_to:
        return True
    for value in export_to:
        if value == "*" or value == namespace or (value == "." and owner_namespace == namespace):
            return True
    return False


@dataclass(frozen=True, slots=True)
class ExportToDefaults:
    """meshConfig's defaultVirtualServiceExportTo and defaultDestinationRuleExportTo: the exportTo
    of the objects that set none (empty: Istio's default, `*`)."""

    virtual_service: tuple[str, ...] = ()
    destination_rule: tuple[str, ...] = ()

    def of_virtual_service(self, vs: VirtualService) -> tuple[str, ...]:
        return vs.export_to or self.virtual_service

    def of_destination_rule(self, rule: DestinationRule) -> tuple[str, ...]:
        """istiod honours only `.` of this default (the rule stays in its namespace); with any other
        value a rule without exportTo is exported to every namespace."""
        return rule.export_to or ((".",) if "." in self.destination_rule else ())


def host_matches(pattern: str, host: str) -> bool:
    """Istio's host matching: `*` all, `*.example.com` any name ending `.example.com`, else exact."""
    if pattern == "*" or pattern == host:
        return True
    if pattern.startswith("*"):
        suffix = pattern[1:]
        return host.endswith(suffix) or (host.startswith("*") and host[1:].endswith(suffix))
    return False


def most_specific(host: str, patterns: Iterable[str]) -> str | None:
    """istiod's MostSpecificHostMatch: an exact match, else the longest wildcard that matches."""
    best = None
    for pattern in patterns:
        if pattern == host:
            return pattern
        if host_matches(pattern, host) and (best is None or len(pattern) > len(best)):
            best = pattern
    return best


def _ordered(items: Iterable[S]) -> list[S]:
    """Ties are broken by namespace and name, so the result never depends on arrival order."""
    return sorted(items, key=lambda i: (i.meta.namespace, i.meta.name))


def virtual_services_for(services: Iterable[VirtualService], namespace: str, gateway: str = MESH_GATEWAY,
                         defaults: ExportToDefaults = ExportToDefaults()) -> list[VirtualService]:
    """VirtualServices a proxy in `namespace` sees, bound to `gateway` (`mesh` or `<ns>/<name>`)."""
    return [vs for vs in _ordered(services)
            if gateway in vs.gateways and exported_to(defaults.of_virtual_service(vs), vs.meta.namespace, namespace)]


def virtual_service_for_host(services: Iterable[VirtualService], namespace: str, host: str,
                             gateway: str = MESH_GATEWAY,
                             defaults: ExportToDefaults = ExportToDefaults()) -> VirtualService | None:
    """The VirtualService whose host matches `host` most specifically (oldest-by-name wins a tie)."""
    candidates = virtual_services_for(services, namespace, gateway, defaults)
    best = most_specific(host, (h for vs in candidates for h in vs.hosts))
    return next((vs for vs in candidates if best in vs.hosts), None) if best else None


def mesh_route_for_host(routes: Mapping[tuple[str, str], VirtualService], namespace: str,
                        host: str) -> VirtualService | None:
    """GAMMA's precedence for the routes on a Service parent (by route namespace and Service host):
    a route of the proxy's own namespace (a consumer route; for the Service's own namespace, the
    producer's), else a route of the Service's namespace (the producer's). A consumer route applies
    to no other namespace, and a route on a Service takes precedence over a VirtualService for its
    host (the caller asks here first)."""
    service_namespace = host.split(".")[1] if "." in host else ""
    return routes.get((namespace, host)) or routes.get((service_namespace, host))


def destination_rule_for(rules: Iterable[DestinationRule], proxy_namespace: str, proxy_labels: Mapping[str, str],
                         host: str, service_namespace: str, root_namespace: str,
                         defaults: ExportToDefaults = ExportToDefaults()) -> DestinationRule | None:
    """istiod's lookup order: the proxy's namespace (its rules need no export; a rule with a
    workloadSelector applies only to the workloads it selects), the service's namespace, then
    the root namespace (both only rules exported to the proxy's namespace)."""
    ordered = _ordered(rules)

    def best(candidates: list[DestinationRule]) -> DestinationRule | None:
        # A rule that selects this workload beats the namespace's rule for the same host.
        candidates.sort(key=lambda r: not r.workload_selector)
        match = most_specific(host, (r.host for r in candidates))
        return next((r for r in candidates if r.host == match), None) if match else None

    local = [r for r in ordered if r.meta.namespace == proxy_namespace
             and selector_matches(r.workload_selector, proxy_labels)]
    if (found := best(local)) is not None:
        return found
    for namespace in dict.fromkeys((service_namespace, root_namespace)):
        if namespace == proxy_namespace:
            continue
        exported = [r for r in ordered if r.meta.namespace == namespace and not r.workload_selector
                    and exported_to(defaults.of_destination_rule(r), r.meta.namespace, proxy_namespace)]
        if (found := best(exported)) is not None:
            return found
    return None


def _selected(items: Iterable[S], namespace: str, labels: Mapping[str, str]) -> tuple[list[S], list[S]]:
    """(objects of `namespace` whose selector matches, and those without a selector)."""
    selecting, default = [], []
    for item in _ordered(items):
        if item.meta.namespace != namespace or bool(getattr(item, "target_refs", None)):  # attached to a waypoint instead
            continue
        # Sidecar and DestinationRule call it workloadSelector, the security kinds selector.
        selector: Labels = getattr(item, "workload_selector", ()) or getattr(item, "selector", ())
        if not selector:
            default.append(item)
        elif selector_matches(selector, labels):
            selecting.append(item)
    return selecting, default


def sidecar_for(sidecars: Iterable[Sidecar], namespace: str, labels: Mapping[str, str],
                root_namespace: str) -> Sidecar | None:
    sidecars = list(sidecars)
    selecting, default = _selected(sidecars, namespace, labels)
    if selecting or default:
        return (selecting or default)[0]
    _, root_default = _selected(sidecars, root_namespace, labels)
    return root_default[0] if root_default else None


def egress_allows(listener: EgressListener, sidecar_namespace: str, host_namespace: str, host: str) -> bool:
    """Whether an egress listener's `hosts` (`ns/dnsName`) let a proxy see `host` of `host_namespace`."""
    for ns, name in listener.hosts:
        if ns == "~":
            continue
        if ns == "." and host_namespace != sidecar_namespace:
            continue
        if ns not in ("*", ".") and ns != host_namespace:
            continue
        if host_matches(name, host):
            return True
    return False


def sidecar_allows(sidecar: Sidecar | None, host_namespace: str, host: str, port: int = 0) -> bool:
    """With no Sidecar every exported host is visible; with one, only those its egress listeners
    name (the listener for `port` if there is one, else the catch-all)."""
    if sidecar is None or not sidecar.egress:
        return True
    listeners = [e for e in sidecar.egress if e.port is not None and e.port.number == port] if port else []
    listeners = listeners or [e for e in sidecar.egress if e.port is None] or ([] if port else list(sidecar.egress))
    return any(egress_allows(e, sidecar.meta.namespace, host_namespace, host) for e in listeners)


def envoy_filters_for(filters: Iterable[EnvoyFilter], namespace: str, labels: Mapping[str, str],
                      root_namespace: str) -> list[EnvoyFilter]:
    """The EnvoyFilters of the root namespace and of the workload's whose workloadSelector matches
    it (or that have none), in the order istiod applies them: priority, then creation time, name
    and namespace, whichever namespace they are in."""
    found = [f for f in filters if f.meta.namespace in (root_namespace, namespace)
             and (not f.workload_selector or selector_matches(f.workload_selector, labels))]
    return sorted(found, key=lambda f: (f.priority, f.created, f.meta.name, f.meta.namespace))


def policies_for(policies: Iterable[S], namespace: str, labels: Mapping[str, str], root_namespace: str,
                 gateway: str = "") -> list[S]:
    """AuthorizationPolicies or RequestAuthentications that apply to a workload: the root
    namespace's and its own namespace's, each when its selector matches (or it has none); for a
    gateway the Gateway API deployed (`gateway`: its Gateway's name), also those of its namespace
    whose targetRefs name that Gateway, as istiod's policy attachment."""
    policies = list(policies)
    result: list[S] = []
    for ns in dict.fromkeys((root_namespace, namespace)):
        selecting, default = _selected(policies, ns, labels)
        result += default + selecting
    if gateway:
        result += [p for p in _ordered(policies) if p.meta.namespace == namespace
                   and ("Gateway", gateway) in getattr(p, "target_refs", ())]
    return result


def peer_authentication_mode(policies: Iterable[PeerAuthentication], namespace: str, labels: Mapping[str, str],
                             root_namespace: str, port: int = 0,
                             default: MTLSMode = MTLSMode.PERMISSIVE) -> MTLSMode:
    """The effective mTLS mode for a workload (and port): workload policy, namespace policy,
    mesh policy, each UNSET level inheriting from the next; `default` (PERMISSIVE) when none says."""
    policies = list(policies)
    selecting, namespace_wide = _selected(policies, namespace, labels)
    _, mesh_wide = _selected(policies, root_namespace, labels)
    chain = selecting[:1] + namespace_wide[:1] + mesh_wide[:1]
    for policy in chain:
        mode = dict(policy.port_level).get(port, MTLSMode.UNSET) if port and policy.selector else MTLSMode.UNSET
        if mode is MTLSMode.UNSET:
            mode = policy.mode
        if mode is not MTLSMode.UNSET:
            return mode
    return default


def gateways_for(gateways: Iterable[Gateway], labels: Mapping[str, str]) -> list[Gateway]:
    """Gateways whose selector picks a gateway workload with these labels (in any namespace, as
    istiod does by default); a Gateway with no selector picks none."""
    return [g for g in _ordered(gateways) if g.selector and selector_matches(g.selector, labels)]


def service_entry_endpoints(entry: ServiceEntry, workload_entries: Iterable[WorkloadEntry]) -> tuple[WorkloadEntry, ...]:
    """A ServiceEntry's endpoints: inline ones, or the WorkloadEntries of its namespace that its
    workloadSelector picks (the Pods it picks are the snapshot builder's to add)."""
    if not entry.workload_selector:
        return entry.endpoints
    return tuple(w for w in _ordered(workload_entries) if w.meta.namespace == entry.meta.namespace
                 and selector_matches(entry.workload_selector, dict(w.labels)))

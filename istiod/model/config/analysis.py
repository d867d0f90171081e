"""Cross-object checks over Istio config, as istioctl analyze makes them (its codes and messages).
Pure: model values in, findings out."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from istiod.model.config import ConfigSet
from istiod.model.config.networking import MESH_GATEWAY, DestinationRule
from istiod.model.config.scope import most_specific
from istiod.model.service import Service
from istiod.model.workload import Workload

ERROR = "Error"


@dataclass(frozen=True, slots=True, order=True)
class Finding:
    origin: str  # `<Kind> <namespace>/<name>`
    code: str
    message: str
    level: str = ERROR

    def line(self) -> str:
        return f"{self.level} [{self.code}] ({self.origin}) {self.message}"

    def json(self) -> dict[str, str]:
        return {"code": self.code, "level": self.level, "origin": self.origin, "message": self.message}


def schema_error(origin: str, error: str) -> Finding:
    return Finding(origin, "IST0106", f"Schema validation error: {error}")


def analyze(config: ConfigSet, services: Iterable[Service], workloads: Iterable[Workload],
            root_namespace: str) -> list[Finding]:
    """Every finding, sorted. `services` and `workloads` are what the cluster or the files hold."""
    services = list(services)
    hosts: dict[str, str] = {s.hostname: s.namespace for s in services}  # host -> the namespace it lives in
    for entry in config.service_entries:
        hosts.update((h, entry.meta.namespace) for h in entry.hosts)
    findings = _virtual_services(config, hosts, root_namespace)
    findings += _gateway_selectors(config, list(workloads))
    findings += _conflicting_destination_rules(config.destination_rules)
    findings += _sidecars_without_selector(config)
    findings += _mesh_host_conflicts(config)
    return sorted(set(findings))


def _known_host(host: str, hosts: Mapping[str, str]) -> str | None:
    """The namespace of the service a destination host names (wildcard ServiceEntries count)."""
    match = most_specific(host, hosts)
    return hosts[match] if match is not None else None


def _virtual_services(config: ConfigSet, hosts: Mapping[str, str], root_namespace: str) -> list[Finding]:
    findings = []
    gateways = {f"{g.meta.namespace}/{g.meta.name}" for g in config.gateways}
    for vs in config.virtual_services:
        origin = f"VirtualService {vs.meta}"
        for gateway in vs.gateways:
            if gateway != MESH_GATEWAY and gateway not in gateways:
                findings.append(Finding(origin, "IST0101", f'Referenced gateway not found: "{gateway}"'))
        routes = [r for http in vs.http for r in http.route] + [r for l4 in vs.tcp + vs.tls for r in l4.route]
        for route in routes:
            destination = route.destination
            namespace = _known_host(destination.host, hosts)
            if namespace is None:
                findings.append(Finding(origin, "IST0101", f'Referenced host not found: "{destination.host}"'))
                continue
            if not destination.subset:
                continue
            rule = config.destination_rule_for(vs.meta.namespace, {}, destination.host, namespace, root_namespace)
            if rule is None or rule.subset(destination.subset) is None:
                findings.append(Finding(origin, "IST0101", "Referenced host+subset in destinationrule not found: "
                                                           f'"{destination.host}+{destination.subset}"'))
    return findings


def _gateway_selectors(config: ConfigSet, workloads: list[Workload]) -> list[Finding]:
    findings = []
    for gateway in config.gateways:
        selector = dict(gateway.selector)
        if not any(all(w.label_map().get(k) == v for k, v in selector.items()) for w in workloads):
            text = ",".join(f"{k}={v}" for k, v in gateway.selector)
            findings.append(Finding(f"Gateway {gateway.meta}", "IST0101", f'Referenced selector not found: "{text}"'))
    return findings


def _conflicting_destination_rules(rules: Iterable[DestinationRule]) -> list[Finding]:
    """Rules of one namespace for the same host, neither narrowed by a workload selector: which one
    a proxy gets depends on their age."""
    by_host: dict[tuple[str, str], list[DestinationRule]] = defaultdict(list)
    for rule in rules:
        if not rule.workload_selector:
            by_host[(rule.meta.namespace, rule.host)].append(rule)
    findings = []
    for (_, host), same in by_host.items():
        if len(same) > 1:
            names = ", ".join(str(r.meta) for r in same)
            for rule in same:
                findings.append(Finding(f"DestinationRule {rule.meta}", "IST0173",
                                        f"DestinationRules {names} have the same host {host}."))
    return findings


def _sidecars_without_selector(config: ConfigSet) -> list[Finding]:
    by_namespace: dict[str, list[str]] = defaultdict(list)
    for sidecar in config.sidecars:
        if not sidecar.workload_selector:
            by_namespace[sidecar.meta.namespace].append(sidecar.meta.name)
    return [Finding(f"Sidecar {namespace}/{name}", "IST0111",
                    f'The Sidecars {names} in namespace "{namespace}" have no workload selector, '
                    "which can lead to undefined behavior.")
            for namespace, names in by_namespace.items() if len(names) > 1 for name in names]


def _mesh_host_conflicts(config: ConfigSet) -> list[Finding]:
    by_host: dict[tuple[str, str], list[str]] = defaultdict(list)
    for vs in config.virtual_services:
        if MESH_GATEWAY in vs.gateways:
            scope = vs.meta.namespace if vs.export_to == (".",) else "*"
            for host in vs.hosts:
                by_host[(scope, host)].append(str(vs.meta))
    return [Finding(f"VirtualService {name}", "IST0109",
                    f"The VirtualServices {','.join(names)} associated with mesh gateway define the same host {host} "
                    "which can lead to undefined behavior. This can be fixed by merging the conflicting "
                    "VirtualServices into a single resource.")
            for (_, host), names in by_host.items() if len(names) > 1 for name in names]


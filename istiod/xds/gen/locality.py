"""Locality load balancing, as istiod's loadbalancer package applies it: EDS priorities relative to
the connecting proxy's locality (failover, failoverPriority) or weights per locality (distribute),
from a DestinationRule's localityLbSetting or the mesh config's. Pure.

Only where a setting changes the assignment (distribute, or failover with outlierDetection set, as
istiod: without ejection a proxy would never leave priority 0) does EDS depend on the proxy; then
on its locality and the labels failoverPriority names, so proxies alike in those still share it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from google.protobuf import wrappers_pb2

from istiod.model.config.networking import LocalityLbSetting, LoadBalancerSettings, PortTrafficPolicy, TrafficPolicy
from istiod.model.proxy import Proxy
from istiod.model.service import Endpoint, Locality
from istiod.model.snapshot import Snapshot
from istiod.model.workload import LOCALITY_LABEL

REGION_LABEL = "topology.kubernetes.io/region"
ZONE_LABEL = "topology.kubernetes.io/zone"
SUBZONE_LABEL = "topology.istio.io/subzone"
NETWORK_LABEL = "topology.istio.io/network"


@dataclass(frozen=True, slots=True)
class LocalityLb:
    """What applies to one cluster: the setting, and whether failover is on (outlierDetection set)."""

    setting: LocalityLbSetting
    failover: bool


def effective_setting(mesh: LocalityLbSetting | None, lb: LoadBalancerSettings | None) -> LocalityLbSetting | None:
    """The rule's setting, else the mesh's; `enabled: false` in the rule turns it off (istiod's
    GetEffectiveLbSetting; the mesh's `enabled: false` is None already)."""
    setting = lb.locality_lb_setting if lb is not None else None
    if setting is None:
        return mesh
    return None if setting.enabled is False else setting


def locality_lb(mesh: LocalityLbSetting | None, policy: TrafficPolicy) -> LocalityLb | None:
    """The locality LB that changes a cluster's endpoints for its proxy, or None when none does."""
    setting = effective_setting(mesh, policy.load_balancer)
    if setting is None or not (setting.distribute or policy.outlier_detection is not None):
        return None
    return LocalityLb(setting, policy.outlier_detection is not None)


def apply_to_cluster(cluster: cluster_pb2.Cluster, mesh: LocalityLbSetting | None, policy: TrafficPolicy) -> None:
    """Envoy weighs localities of one priority by load_balancing_weight only with locality weighted
    LB on: istiod turns it on for distribute, and for explicit failover with outlier detection."""
    setting = effective_setting(mesh, policy.load_balancer)
    if setting is None:
        return
    failover = policy.outlier_detection is not None and bool(setting.failover or setting.failover_priority)
    if failover or setting.distribute:
        cluster.common_lb_config.locality_weighted_lb_config.SetInParent()


def proxy_locality(snapshot: Snapshot, proxy: Proxy) -> Locality:
    """istiod's order: the registry's (the pod's `istio-locality` label, else its Node's topology
    labels), the topology labels or `istio-locality` label the proxy sends, then the bootstrap's."""
    pod = snapshot.workloads.get((proxy.namespace, proxy.pod_name))
    if pod is not None and (found := pod.locality(snapshot.nodes.get(pod.node_name))) != Locality():
        return found
    labels = dict(proxy.labels)
    if any(k in labels for k in (REGION_LABEL, ZONE_LABEL, SUBZONE_LABEL)):
        return Locality(labels.get(REGION_LABEL, ""), labels.get(ZONE_LABEL, ""), labels.get(SUBZONE_LABEL, ""))
    if labels.get(LOCALITY_LABEL):
        return Locality.parse(labels[LOCALITY_LABEL])
    return proxy.locality


def topology_labels(labels: Sequence[tuple[str, str]], locality: Locality) -> dict[str, str]:
    """Labels with the locality's topology labels added, as istiod augments proxies' and endpoints'
    (what failoverPriority compares)."""
    augmented = dict(labels)
    for key, value in ((REGION_LABEL, locality.region), (ZONE_LABEL, locality.zone), (SUBZONE_LABEL, locality.subzone)):
        if value:
            augmented.setdefault(key, value)
    return augmented


def priority_label_keys(snapshot: Snapshot) -> frozenset[str] | None:
    """The label names any failoverPriority reads, or None when no locality LB can apply in this
    snapshot (then EDS is shared across localities). A mesh distribute applies to every cluster;
    otherwise a rule must set outlierDetection or a localityLbSetting somewhere."""
    mesh = snapshot.mesh.locality_lb_setting
    settings = [mesh] if mesh is not None else []
    in_use = bool(mesh is not None and mesh.distribute)
    for rule in snapshot.config.all_destination_rules:
        for policy in (rule.traffic_policy, *(s.traffic_policy for s in rule.subsets)):
            layers: tuple[TrafficPolicy | PortTrafficPolicy, ...] = (
                (policy, *policy.port_level_settings) if policy is not None else ())
            for layer in layers:
                own = layer.load_balancer.locality_lb_setting if layer.load_balancer is not None else None
                in_use = in_use or layer.outlier_detection is not None or own is not None
                settings += [own] if own is not None else []
    if not in_use:
        return None
    return frozenset(key.partition("=")[0] for setting in settings for key in setting.failover_priority)


def view(snapshot: Snapshot, proxy: Proxy, keys: frozenset[str] | None) -> tuple[object, ...]:
    """All of a proxy that EDS reads for locality LB (a cache key): nothing when none applies."""
    if keys is None:
        return ()
    locality = proxy_locality(snapshot, proxy)
    labels = topology_labels(proxy.labels, locality)
    return locality, tuple((key, labels.get(key, "")) for key in sorted(keys))


def apply(assignment: endpoint_pb2.ClusterLoadAssignment, groups: Sequence[Sequence[Endpoint]], lb: LocalityLb,
          locality: Locality, proxy_labels: Mapping[str, str]) -> None:
    """Priorities or weights onto an assignment whose i-th locality holds `groups[i]` (istiod's
    ApplyLocalityLoadBalancer)."""
    setting = lb.setting
    if setting.distribute:
        _apply_weights(assignment, locality, setting)
    elif lb.failover:
        if setting.failover_priority:
            _apply_failover_priorities(assignment, groups, proxy_labels, setting.failover_priority)
            if setting.failover:
                _apply_locality_failover(assignment, locality, setting)
        else:
            _apply_locality_failover(assignment, locality, setting)


def locality_matches(locality: Locality, rule: str) -> bool:
    """`region/zone/subzone` of a distribute rule, `*` (or a missing part) matching any."""
    region, zone, subzone = (rule.split("/", 2) + ["", ""])[:3]
    return (region in ("*", locality.region) and zone in ("*", "", locality.zone)
            and subzone in ("*", "", locality.subzone))


def _of(group: endpoint_components_pb2.LocalityLbEndpoints) -> Locality:
    return Locality(group.locality.region, group.locality.zone, group.locality.sub_zone)


def _apply_weights(assignment: endpoint_pb2.ClusterLoadAssignment, locality: Locality,
                   setting: LocalityLbSetting) -> None:
    """The first rule whose `from` matches the proxy: each `to` locality gets its weight (shared by
    the localities a wildcard matches, in proportion to theirs); localities no `to` names get no
    endpoints."""
    rule = next((d for d in setting.distribute if locality_matches(locality, d.from_locality)), None)
    if rule is None:
        return
    unmatched = set(range(len(assignment.endpoints)))
    for target, weight in rule.to:
        matched = {i: assignment.endpoints[i].load_balancing_weight.value or 1 for i in sorted(unmatched)
                   if locality_matches(_of(assignment.endpoints[i]), target)}
        unmatched -= set(matched)
        total = sum(matched.values())
        for i, original in matched.items():
            assignment.endpoints[i].load_balancing_weight.value = math.ceil(original * weight / total)
    for i in unmatched:
        del assignment.endpoints[i].lb_endpoints[:]


def _priority(proxy: Locality, endpoint: Locality) -> int:
    """0: same subzone, 1: same zone, 2: same region, 3: elsewhere (istiod's LbPriority)."""
    if proxy.region != endpoint.region:
        return 3
    if proxy.zone != endpoint.zone:
        return 2
    return 0 if proxy.subzone == endpoint.subzone else 1


def _apply_locality_failover(assignment: endpoint_pb2.ClusterLoadAssignment, locality: Locality,
                             setting: LocalityLbSetting) -> None:
    """Priority by nearness; of other regions, the proxy region's failover target comes before the
    rest (4). Composed with priorities already set (times 5), then made contiguous from 0."""
    target = next((f.to_region for f in setting.failover if f.from_region == locality.region), None)
    for group in assignment.endpoints:
        priority = _priority(locality, _of(group))
        if priority == 3 and target is not None and group.locality.region != target:
            priority = 4
        group.priority = group.priority * 5 + priority
    _compact(assignment.endpoints)


def _compact(groups: Sequence[endpoint_components_pb2.LocalityLbEndpoints]) -> None:
    """Priorities must run from 0 without a gap."""
    rank = {p: i for i, p in enumerate(sorted({g.priority for g in groups}))}
    for group in groups:
        group.priority = rank[group.priority]


def _apply_failover_priorities(assignment: endpoint_pb2.ClusterLoadAssignment, groups: Sequence[Sequence[Endpoint]],
                               proxy_labels: Mapping[str, str], priorities: Sequence[str]) -> None:
    """Each locality split by how many of the labels (in order) its endpoints share with the proxy:
    all of them is priority 0. A `name=value` entry compares with that value instead of the proxy's.
    A leading network label that differs only lowers priority below all the rest (istiod's)."""
    if not proxy_labels or not groups:
        return
    names = [p.partition("=")[0] for p in priorities]
    overrides = {name: value for name, sep, value in (p.partition("=") for p in priorities) if sep}
    with_network = names[0] == NETWORK_LABEL
    split: list[endpoint_components_pb2.LocalityLbEndpoints] = []
    for group, members in zip(list(assignment.endpoints), groups):
        by_priority: dict[int, list[int]] = {}
        for index, endpoint in enumerate(members):
            labels = topology_labels(endpoint.labels, endpoint.locality)
            priority = adjust = 0
            for j, name in enumerate(names):
                if overrides.get(name, proxy_labels.get(name, "")) != labels.get(name, ""):
                    if j == 0 and with_network:
                        adjust = len(names)
                        continue
                    priority = len(names) - j
                    break
            by_priority.setdefault(priority + adjust, []).append(index)
        for priority in sorted(by_priority):
            part = endpoint_components_pb2.LocalityLbEndpoints()
            part.CopyFrom(group)
            del part.lb_endpoints[:]
            part.lb_endpoints.extend(group.lb_endpoints[i] for i in by_priority[priority])
            part.priority = priority
            part.load_balancing_weight.CopyFrom(wrappers_pb2.UInt32Value(
                value=sum(e.load_balancing_weight.value for e in part.lb_endpoints)))
            split.append(part)
    _compact(split)
    del assignment.endpoints[:]
    assignment.endpoints.extend(split)

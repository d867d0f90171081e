"""localityLbSetting: validation naming the field (Istio's rules), and the translation into EDS
priorities and weights relative to the proxy and the cluster's locality weighted LB config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2

from istiod.model.config.networking import (
    LoadBalancerSettings, LocalityDistribute, LocalityFailover, LocalityLbSetting, OutlierDetection, TrafficPolicy,
)
from istiod.model.builder import build_snapshot
from istiod.model.mesh import MeshConfig
from istiod.model.proxy import Proxy, proxy_from_node
from istiod.model.service import Endpoint, Locality
from istiod.model.snapshot import Snapshot
from istiod.sources.convert import ConversionError, convert
from istiod.sources.meshconfig import MeshConfigError, parse_mesh_config
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import SIDECAR, eds, locality
from istiod.xds.gen.eds import load_assignment

DATA = Path(__file__).parent / "data"


def _rule(setting: dict[str, Any], outlier: bool = True) -> dict[str, Any]:
    policy: dict[str, Any] = {"loadBalancer": {"localityLbSetting": setting}}
    if outlier:
        policy["outlierDetection"] = {"consecutive5xxErrors": 1}
    return {"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule", "metadata": {"name": "r", "namespace": "ns"},
            "spec": {"host": "echo", "trafficPolicy": policy}}


@pytest.mark.parametrize(("setting", "error"), [
    ({"distribute": [{"from": "r1/*", "to": {"r1/*": 60}}]}, r"distribute\[0\]: to: total locality weight 60 != 100"),
    ({"distribute": [{"from": "r1/*", "to": {"r1/*": 0, "r2/*": 100}}]}, "locality weight must be in range"),
    ({"distribute": [{"from": "r1/*", "to": {"r1/*": 100}}], "failover": [{"from": "r1", "to": "r2"}]},
     "can not simultaneously specify 'distribute' and 'failover'"),
    ({"failover": [{"from": "r1", "to": "r1"}]}, r"failover\[0\]: locality lb failover settings must specify different regions"),
    ({"failover": [{"from": "r1/z1", "to": "r2"}]}, "locality lb failover only specify region"),
    ({"failover": [{"from": "r*", "to": "r2"}]}, "should not contain '\\*' wildcard"),
    ({"failover": [{"from": "r1", "to": "r2"}], "failoverPriority": ["topology.kubernetes.io/zone"]},
     "can not simultaneously set 'failover' and topology label 'topology.kubernetes.io/zone'"),
    ({"distribute": [{"from": "r1/*/z", "to": {"r1": 100}}]}, "wildcard '\\*' number can not exceed 1 and must be in the end"),
    ({"distribute": [{"from": "r1//z", "to": {"r1": 100}}]}, "must not contain empty region/zone/subzone info"),
    ({"distribute": [{"from": "r1", "to": {"r1": 100}}, {"from": "r1/z1", "to": {"r1": 100}}]},
     "distribute: locality r1/z1 overlap with previous specified ones"),
    ({"distribute": [{"from": "r1", "to": {"r1/z1": 50, "r1/z1/s1": 50}}]}, "to: locality r1/z1/s1 overlap"),
    ({"enabled": "yes"}, "enabled"),
    ({"other": 1}, "unknown field 'other'"),
])
def test_a_bad_setting_is_refused_naming_the_field(setting: dict[str, Any], error: str) -> None:
    with pytest.raises(ConversionError, match=error) as raised:
        convert(_rule(setting))
    assert "localityLbSetting" in str(raised.value)


def test_overlap_is_order_dependent_as_in_istio() -> None:
    """istioctl validate accepts `r1/*` after `r1/z` (and refuses `r1/z` after `r1/*`)."""
    convert(_rule({"distribute": [{"from": "r1/z", "to": {"r1": 100}}, {"from": "r1/*", "to": {"r1": 100}}]}))
    with pytest.raises(ConversionError, match="overlap"):
        convert(_rule({"distribute": [{"from": "r1/*", "to": {"r1": 100}}, {"from": "r1/z", "to": {"r1": 100}}]}))


def test_zone_aware_lb_stays_refused() -> None:
    body = _rule({})
    body["spec"]["trafficPolicy"]["loadBalancer"] = {"zoneAwareLbSetting": {}}
    with pytest.raises(ConversionError, match="zoneAwareLbSetting is not supported"):
        convert(body)


def test_a_good_setting_is_read() -> None:
    _, rule = convert(_rule({"distribute": [{"from": "r1/z1/*", "to": {"r1/z1/*": 80, "r1/z2/*": 20}}], "enabled": True}))
    assert rule.traffic_policy.load_balancer.locality_lb_setting == LocalityLbSetting(
        distribute=(LocalityDistribute("r1/z1/*", (("r1/z1/*", 80), ("r1/z2/*", 20))),), enabled=True)


def test_mesh_config_setting_is_the_default_and_can_be_off() -> None:
    assert MeshConfig().locality_lb_setting == LocalityLbSetting(enabled=True)  # Istio's default
    mesh = parse_mesh_config("localityLbSetting: {failover: [{from: r1, to: r2}]}", MeshConfig(), "mesh")
    assert mesh.locality_lb_setting == LocalityLbSetting(failover=(LocalityFailover("r1", "r2"),))
    assert parse_mesh_config("localityLbSetting: {enabled: false}", MeshConfig(), "mesh").locality_lb_setting is None
    with pytest.raises(MeshConfigError, match="mesh.localityLbSetting.failover.0.|failover\\[0\\]"):
        parse_mesh_config("localityLbSetting: {failover: [{from: r1, to: r1}]}", MeshConfig(), "mesh")


PROXY = Locality("r1", "z1", "s1")
ENDPOINTS = (
    Endpoint("10.0.0.1", 80, 80, locality=Locality("r1", "z1", "s1")),
    Endpoint("10.0.0.2", 80, 80, locality=Locality("r1", "z1", "s2")),
    Endpoint("10.0.0.3", 80, 80, locality=Locality("r1", "z2", "s1")),
    Endpoint("10.0.0.4", 80, 80, locality=Locality("r2", "z1", "s1")),
    Endpoint("10.0.0.5", 80, 80, locality=Locality("r3", "z1", "s1")),
)


def _assign(setting: LocalityLbSetting, failover: bool = True, labels: dict[str, str] | None = None,
            endpoints: tuple[Endpoint, ...] = ENDPOINTS) -> dict[str, tuple[int, int]]:
    """address -> (priority, locality weight)."""
    made = load_assignment("c", endpoints, locality.LocalityLb(setting, failover), (PROXY, labels or {}))
    return {e.endpoint.address.socket_address.address: (group.priority, group.load_balancing_weight.value)
            for group in made.endpoints for e in group.lb_endpoints}


def test_failover_by_nearness() -> None:
    priorities = {a: p for a, (p, _) in _assign(LocalityLbSetting(enabled=True)).items()}
    assert priorities == {"10.0.0.1": 0, "10.0.0.2": 1, "10.0.0.3": 2, "10.0.0.4": 3, "10.0.0.5": 3}


def test_failover_region_comes_before_other_regions() -> None:
    priorities = {a: p for a, (p, _) in _assign(LocalityLbSetting(failover=(LocalityFailover("r1", "r3"),))).items()}
    assert priorities == {"10.0.0.1": 0, "10.0.0.2": 1, "10.0.0.3": 2, "10.0.0.5": 3, "10.0.0.4": 4}


def test_no_failover_without_outlier_detection() -> None:
    assert {p for p, _ in _assign(LocalityLbSetting(enabled=True), failover=False).values()} == {0}
    assert locality.locality_lb(LocalityLbSetting(enabled=True), TrafficPolicy()) is None
    on = TrafficPolicy(outlier_detection=OutlierDetection(consecutive_5xx_errors=1))
    assert locality.locality_lb(LocalityLbSetting(enabled=True), on) == locality.LocalityLb(LocalityLbSetting(enabled=True), True)
    off = TrafficPolicy(LoadBalancerSettings(locality_lb_setting=LocalityLbSetting(enabled=False)), outlier_detection=on.outlier_detection)
    assert locality.locality_lb(LocalityLbSetting(enabled=True), off) is None  # the rule's enabled: false wins


def test_distribute_weights_and_drops_unnamed_localities() -> None:
    setting = LocalityLbSetting(distribute=(
        LocalityDistribute("r9/*", (("r9/*", 100),)),  # not the proxy's: skipped
        LocalityDistribute("r1/z1/*", (("r1/z1/*", 60), ("r2/*", 40))),
    ))
    made = load_assignment("c", ENDPOINTS, locality.LocalityLb(setting, False), (PROXY, {}))
    groups = {str(Locality(g.locality.region, g.locality.zone, g.locality.sub_zone)): g for g in made.endpoints}
    # r1/z1/* matches two localities of weight 1 each: 60 shared, 30 each; unnamed ones keep no endpoints.
    assert {k: (g.load_balancing_weight.value, len(g.lb_endpoints)) for k, g in groups.items()} == {
        "r1/z1/s1": (30, 1), "r1/z1/s2": (30, 1), "r1/z2/s1": (1, 0), "r2/z1/s1": (40, 1), "r3/z1/s1": (1, 0)}


def test_failover_priority_by_labels() -> None:
    endpoints = (
        Endpoint("10.0.0.1", 80, 80, locality=Locality("r1", "z1"), labels=(("version", "v1"),)),
        Endpoint("10.0.0.2", 80, 80, locality=Locality("r1", "z1"), labels=(("version", "v2"),)),
        Endpoint("10.0.0.3", 80, 80, locality=Locality("r1", "z2"), labels=(("version", "v1"),)),
    )
    keys = ("version", "topology.kubernetes.io/zone")
    proxy_labels = locality.topology_labels((("version", "v1"),), Locality("r1", "z1"))
    priorities = {a: p for a, (p, _) in _assign(LocalityLbSetting(failover_priority=keys), labels=proxy_labels,
                                                endpoints=endpoints).items()}
    # Both labels match: 0; version only: 1; neither: 2.
    assert priorities == {"10.0.0.1": 0, "10.0.0.3": 1, "10.0.0.2": 2}
    # `name=value` compares with that value, not the proxy's.
    overridden = {a: p for a, (p, _) in _assign(LocalityLbSetting(failover_priority=("version=v2",)), labels=proxy_labels,
                                                endpoints=endpoints).items()}
    assert overridden == {"10.0.0.2": 0, "10.0.0.1": 1, "10.0.0.3": 1}


@pytest.mark.parametrize(("setting", "outlier", "weighted"), [
    (LocalityLbSetting(distribute=(LocalityDistribute("r1", (("r1", 100),)),)), False, True),
    (LocalityLbSetting(failover=(LocalityFailover("r1", "r2"),)), True, True),
    (LocalityLbSetting(failover=(LocalityFailover("r1", "r2"),)), False, False),
    (LocalityLbSetting(enabled=True), True, False),  # the default failover: no weighted config, as istiod
])
def test_cluster_locality_weighted_lb_config(setting: LocalityLbSetting, outlier: bool, weighted: bool) -> None:
    cluster = cluster_pb2.Cluster()
    policy = TrafficPolicy(outlier_detection=OutlierDetection(consecutive_5xx_errors=1) if outlier else None)
    locality.apply_to_cluster(cluster, setting, policy)
    assert cluster.common_lb_config.HasField("locality_weighted_lb_config") is weighted


def test_locality_matches_wildcards() -> None:
    assert locality.locality_matches(Locality("r1", "z1", "s1"), "r1/*")
    assert locality.locality_matches(Locality("r1", "z1", "s1"), "r1")
    assert locality.locality_matches(Locality("r1", "z1", "s1"), "*")
    assert not locality.locality_matches(Locality("r1", "z1", "s1"), "r1/z2/*")


def _snapshot(rules: bool = True) -> Snapshot:
    store = Store()
    for document in yaml.safe_load_all((DATA / "locality-compare-mesh.yaml").read_text()):
        if rules or document["kind"] != "DestinationRule":
            store.apply(document)
    return build_snapshot(store, "v1")


def _sidecar(pod: str, ip: str, labels: dict[str, str] | None = None, where: Locality = Locality()) -> Proxy:
    return proxy_from_node(f"sidecar~{ip}~{pod}.demo~demo.svc.cluster.local", {"LABELS": labels or {}}, where)


def test_proxy_locality_registry_first_then_labels_then_bootstrap() -> None:
    snapshot = _snapshot()
    # client-1's pod runs on node-a: its Node's labels win over the bootstrap's.
    assert locality.proxy_locality(snapshot, _sidecar("client-1", "10.244.0.30", where=Locality("r9"))) == Locality("r1", "zone-a")
    labelled = {"topology.kubernetes.io/region": "r2", "topology.kubernetes.io/zone": "zone-c"}
    assert locality.proxy_locality(snapshot, _sidecar("vm-1", "10.0.0.9", labelled, Locality("r9"))) == Locality("r2", "zone-c")
    assert locality.proxy_locality(snapshot, _sidecar("vm-1", "10.0.0.9", {"istio-locality": "r3.z.s"})) == Locality("r3", "z", "s")
    assert locality.proxy_locality(snapshot, _sidecar("vm-1", "10.0.0.9", where=Locality("r9", "z9"))) == Locality("r9", "z9")


def _eds(snapshot: Snapshot, proxy: Proxy, cache: ResourceCache) -> dict[str, bytes]:
    return {r.name: r.value for r in SIDECAR[types.ENDPOINT](snapshot, proxy, None, cache)}


def test_eds_is_made_per_locality_only_where_a_setting_applies() -> None:
    zone_a = _sidecar("vm-a", "10.0.0.8", where=Locality("r1", "zone-a"))
    zone_a_too = _sidecar("vm-a2", "10.0.0.7", where=Locality("r1", "zone-a"))
    zone_c = _sidecar("vm-c", "10.0.0.9", where=Locality("r2", "zone-c"))
    spread = "outbound|80||spread.demo.svc.cluster.local"

    snapshot, cache = _snapshot(), ResourceCache()
    a, c = _eds(snapshot, zone_a, cache), _eds(snapshot, zone_c, cache)
    assert a[spread] != c[spread]  # distribute from r1/zone-a applies to zone-a's proxy only
    # Proxies of one locality share what was made, serialized once.
    first, second = SIDECAR[types.ENDPOINT](snapshot, zone_a, None, cache), SIDECAR[types.ENDPOINT](snapshot, zone_a_too, None, cache)
    assert [r.value for r in first] == [r.value for r in second]
    assert all(x is y for x, y in zip(first, second))

    # Without any rule (outlier detection nowhere, the mesh's default enabled: true) EDS does not
    # depend on the locality: one key, one list for every zone.
    plain, cache = _snapshot(rules=False), ResourceCache()
    assert eds.alike_for_eds(plain, zone_a, cache) == eds.alike_for_eds(plain, zone_c, cache)
    assert all(x is y for x, y in zip(SIDECAR[types.ENDPOINT](plain, zone_a, None, cache),
                                      SIDECAR[types.ENDPOINT](plain, zone_c, None, cache)))

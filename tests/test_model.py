"""Conversion of Kubernetes objects and the snapshot builder, on data fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from istiod.model.builder import build_snapshot
from istiod.model.service import Locality
from istiod.sources.convert import ConversionError, ObjectKey, convert
from istiod.sources.store import EventType, Store

DATA = Path(__file__).parent / "data"


def load_store(name: str) -> Store:
    store = Store()
    for doc in yaml.safe_load_all((DATA / name).read_text()):
        store.apply(doc)
    return store


def test_selector_endpoints_resolve_named_target_ports_and_health() -> None:
    snapshot = build_snapshot(load_store("model-mesh.yaml"), "v1")
    web = snapshot.endpoints_for("web.shop.svc.cluster.local", 80)
    assert [(e.address, e.port, e.healthy) for e in web] == [("10.0.0.1", 8080, True), ("10.0.0.2", 8080, False)]
    first, second = web
    assert first.locality == Locality("r1", "z1", "s1")  # from the Node
    assert second.locality == Locality("r2", "z2", "")  # the pod label wins
    assert (first.workload_name, first.workload_kind, first.service_account) == ("web", "Deployment", "web-sa")
    # A numeric targetPort needs no container port of that name.
    assert [e.port for e in snapshot.endpoints_for("web.shop.svc.cluster.local", 9000)] == [9901, 9901]


def test_slice_endpoints_and_finished_jobs() -> None:
    snapshot = build_snapshot(load_store("model-mesh.yaml"), "v1")
    api = snapshot.endpoints_for("api.shop.svc.cluster.local", 7070)
    # 10.0.1.3 belongs to a finished CronJob's Job: it leaves the endpoints.
    assert [(e.address, e.port, e.healthy) for e in api] == [("10.0.1.1", 7071, True), ("10.0.1.2", 7071, True)]
    assert api[0].service_account == "api-sa" and api[0].locality == Locality("r1", "z1", "s1")
    assert api[1].locality == Locality(zone="z9") and api[1].workload_name == ""
    assert snapshot.workloads[("shop", "batch-29412360-q")].workload_kind == "CronJob"
    # Selector endpoints drop the finished Job's pod too, though it is Ready and labelled app=web.
    assert "10.0.0.9" not in {e.address for e in snapshot.endpoints_for("web.shop.svc.cluster.local", 80)}


def test_volume_mounts() -> None:
    (mount,) = build_snapshot(load_store("model-mesh.yaml"), "v1").volumes
    assert mount.volume.capacity is not None and mount.volume.capacity.value == 3 * 2**29
    assert mount.volume.access_modes == ("ReadWriteOnce", "ReadOnlyMany")
    assert mount.claim is not None and mount.claim.requested is not None and mount.claim.requested.value == 2**30
    assert [(w.name, w.workload_name, w.workload_kind) for w in mount.mounted_by] == [
        ("batch-29412360-q", "batch", "CronJob")
    ]


def test_unchanged_endpoints_are_carried_over_as_the_same_object() -> None:
    store = load_store("model-mesh.yaml")
    changes: list[ObjectKey] = []
    store.subscribe(lambda change: changes.append(change.key))
    first = build_snapshot(store, "v1")
    store.apply({"kind": "Service", "metadata": {"name": "other", "namespace": "elsewhere"}, "spec": {"ports": [{"port": 1}]}})
    second = build_snapshot(store, "v2", first, changes)
    key = ("web.shop.svc.cluster.local", 80)
    assert second.endpoints[key] is first.endpoints[key]
    changes.clear()
    store.delete(ObjectKey("Pod", "shop", "web-abc12-2"))
    third = build_snapshot(store, "v3", second, changes)
    assert [e.address for e in third.endpoints[key]] == ["10.0.0.1"]


def test_store_events_and_unchanged_writes() -> None:
    store = Store()
    events: list[tuple[EventType, str]] = []
    store.subscribe(lambda change: events.append((change.type, change.key.name)))
    ns = {"kind": "Namespace", "metadata": {"name": "a", "resourceVersion": "1"}}
    store.apply(ns)
    store.apply({**ns, "metadata": {"name": "a", "resourceVersion": "2"}})  # only the version moved
    store.apply({"kind": "Namespace", "metadata": {"name": "a", "labels": {"x": "y"}}})
    store.delete(ObjectKey("Namespace", "", "a"))
    store.delete(ObjectKey("Namespace", "", "a"))
    assert events == [(EventType.ADDED, "a"), (EventType.UPDATED, "a"), (EventType.DELETED, "a")]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "expected a Kubernetes object"),
        ({"metadata": {"name": "x"}}, "object has no kind"),
        ({"kind": "Service", "metadata": {}}, "Service has no metadata.name"),
        ({"kind": "Widget", "metadata": {"name": "w"}}, "kind 'Widget' is not one istiod reads"),
        ({"kind": "Service", "metadata": {"name": "s"}, "spec": {"ports": [{"port": "80"}]}},
         "Service default/s spec.ports[0]: port: expected int, got str"),
        ({"kind": "Service", "metadata": {"name": "s"}, "spec": {"ports": [{"port": 80}, {"port": 80}]}},
         "Service default/s: spec.ports has the same port twice"),
        ({"kind": "Service", "metadata": {"name": "s"}, "spec": {"ports": [{"port": 80, "targetPort": True}]}},
         "targetPort must be a number or a name"),
        ({"kind": "Service", "metadata": {"name": "s"}, "spec": {"selector": {"app": 1}}},
         "spec.selector: keys and values must be strings"),
        ({"kind": "Pod", "metadata": {"name": "p", "labels": "app=x"}}, "metadata.labels: expected dict, got str"),
        ({"kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": ["c"]}}, "spec.containers[0]: expected a map"),
        ({"kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [{"ports": [{"containerPort": 0}]}]}},
         "containerPort 0 is not in 1-65535"),
        ({"kind": "PersistentVolume", "metadata": {"name": "pv"}, "spec": {"capacity": {"storage": "1.2.3Gi"}}},
         "PersistentVolume pv: spec.capacity.storage: quantity '1.2.3Gi' has an unknown suffix"),
        ({"kind": "EndpointSlice", "metadata": {"name": "e"}, "endpoints": [{"addresses": [1]}]},
         "endpoints[].addresses must be strings"),
        ({"kind": "Pod", "metadata": {"name": "p"}, "status": {"podIP": "999.1.1.1"}},
         "Pod default/p: status.podIP: '999.1.1.1' is not an IP address"),
        ({"kind": "Pod", "metadata": {"name": "p"}, "status": {"podIP": "10.0.0.01"}}, "is not an IP address"),
        ({"kind": "Pod", "metadata": {"name": "p"}, "status": {"podIP": "fe80::1%eth0"}}, "is not an IP address"),
        ({"kind": "EndpointSlice", "metadata": {"name": "e"}, "endpoints": [{"addresses": ["10.0.0.1", "not-an-ip"]}]},
         "EndpointSlice default/e: endpoints[0].addresses[1]: 'not-an-ip' is not an IPv4 address"),
        ({"kind": "EndpointSlice", "metadata": {"name": "e"}, "addressType": "IPv6", "endpoints": [{"addresses": ["10.0.0.1"]}]},
         "endpoints[0].addresses[0]: '10.0.0.1' is not an IPv6 address"),
        ({"kind": "Service", "metadata": {"name": "s"}, "spec": {"clusterIP": "10.0.0.256"}},
         "spec.clusterIP: '10.0.0.256' is not an IP address"),
        ({"kind": "Service", "metadata": {"name": "we*ird"}}, "metadata.name 'we*ird' is not a DNS-1035 label"),
        ({"kind": "Service", "metadata": {"name": "9lives"}}, "metadata.name '9lives' is not a DNS-1035 label"),
        ({"kind": "Namespace", "metadata": {"name": "a.b"}}, "metadata.name 'a.b' is not a DNS-1123 label"),
        ({"kind": "Pod", "metadata": {"name": "Upper"}}, "metadata.name 'Upper' is not a DNS-1123 subdomain"),
        ({"kind": "Pod", "metadata": {"name": "p", "namespace": "under_score"}},
         "metadata.namespace 'under_score' is not a DNS-1123 label"),
    ],
)
def test_conversion_errors_name_the_object_and_field(body: object, message: str) -> None:
    with pytest.raises(ConversionError) as error:
        convert(body)  # type: ignore[arg-type]
    assert message in str(error.value)


def test_failed_update_keeps_the_last_good_state() -> None:
    store = Store()
    good = {"kind": "Service", "metadata": {"name": "s", "namespace": "n"}, "spec": {"ports": [{"port": 80}]}}
    store.apply(good)
    with pytest.raises(ConversionError):
        store.apply({**good, "spec": {"ports": [{"port": 0}]}})
    stored = store.get(ObjectKey("Service", "n", "s"))
    assert stored is not None and stored.value.ports[0].port == 80


PICKING_ENTRY = """
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: web-ext, namespace: shop}
spec:
  hosts: [web.ext.test]
  location: MESH_INTERNAL
  resolution: STATIC
  workloadSelector: {labels: {app: web}}
  ports:
  - {number: 8443, name: http, protocol: HTTP}
  - {number: 9443, name: admin, protocol: HTTP, targetPort: 9901}
  - {number: 7443, name: tcp, protocol: TCP}
---
apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: vm, namespace: shop}
spec: {address: 192.0.2.1, labels: {app: web}}
---
apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: other, labels: {app: web}}
status: {phase: Running, podIP: 10.0.9.1, conditions: [{type: Ready, status: "True"}]}
"""


def test_a_service_entrys_workload_selector_picks_pods_of_its_namespace() -> None:
    """As istiod's ServiceEntry controller: the WorkloadEntries and the Pods of the entry's namespace
    it selects, each Pod at its container port named as the entry's port, else the targetPort or
    the port's number; unready ones unhealthy, finished ones (a done Job's) left out."""
    store = load_store("model-mesh.yaml")
    for doc in yaml.safe_load_all(PICKING_ENTRY):
        store.apply(doc)
    changed: list[ObjectKey] = []
    store.subscribe(lambda change: changed.append(change.key))
    snapshot = build_snapshot(store, "v1")
    endpoints = {port: [(e.address, e.port, e.healthy) for e in snapshot.endpoints_for("web.ext.test", port)]
                 for port in (8443, 9443, 7443)}
    assert endpoints == {
        8443: [("192.0.2.1", 8443, True), ("10.0.0.1", 8080, True), ("10.0.0.2", 8080, False)],
        9443: [("192.0.2.1", 9901, True), ("10.0.0.1", 9901, True), ("10.0.0.2", 9901, False)],
        7443: [("192.0.2.1", 7443, True), ("10.0.0.1", 7443, True), ("10.0.0.2", 7443, False)],
    }
    pod = snapshot.endpoints_for("web.ext.test", 8443)[1]
    assert (pod.pod, pod.service_account, pod.locality, pod.namespace) == ("web-abc12-1", "web-sa",
                                                                           Locality("r1", "z1", "s1"), "shop")
    # A Pod relabelled away leaves the entry's endpoints in an incremental build.
    relabelled = next(doc for doc in yaml.safe_load_all((DATA / "model-mesh.yaml").read_text())
                      if doc["metadata"]["name"] == "web-abc12-1")
    relabelled["metadata"]["labels"]["app"] = "gone"
    store.apply(relabelled)
    after = build_snapshot(store, "v2", snapshot, list(changed))
    assert [e.address for e in after.endpoints_for("web.ext.test", 8443)] == ["192.0.2.1", "10.0.0.2"]

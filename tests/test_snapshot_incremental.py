"""A snapshot built from the previous one and the changed keys equals a whole build (hypothesis)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from istiod.model.builder import build_snapshot
from istiod.model.snapshot import Lookups, Selection, Snapshot
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Store
from tests.test_gateway_gen import CREDENTIAL, tls_secret

NAMESPACES = ("n1", "n2")
APPS = ("a", "b")
ADDRESSES = ("10.0.0.1", "10.0.0.2", "10.0.0.3")  # few, so addresses collide across pods and entries
NAMES = ("a", "b", "c")

namespaces = st.sampled_from(NAMESPACES)
labels = st.dictionaries(st.sampled_from(("app", "version")), st.sampled_from(APPS), max_size=2)


def _meta(kind: str, name: str, namespace: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "metadata": {"name": name, "namespace": namespace, **extra}}


@st.composite
def services(draw: st.DrawFn) -> dict[str, Any]:
    ports = draw(st.lists(st.sampled_from(({"name": "http", "port": 80, "targetPort": "http"},
                                           {"name": "grpc", "port": 7070})), min_size=1, max_size=2, unique_by=str))
    selector = draw(st.one_of(st.none(), st.dictionaries(st.just("app"), st.sampled_from(APPS), min_size=1)))
    spec: dict[str, Any] = {"ports": ports, **({"selector": selector} if selector else {})}
    return {"apiVersion": "v1", **_meta("Service", draw(st.sampled_from(NAMES)), draw(namespaces)), "spec": spec}


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    name = f"p{draw(st.integers(0, 3))}"
    phase = draw(st.sampled_from(("Running", "Running", "Succeeded")))
    ready = draw(st.booleans())
    claims = draw(st.sampled_from(([], [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}])))
    return {"apiVersion": "v1", **_meta("Pod", name, draw(namespaces), labels=draw(labels)),
            "spec": {"nodeName": "node1", "volumes": claims,
                     "containers": [{"name": "c", "ports": [{"name": "http", "containerPort": draw(st.sampled_from((8080, 9090)))}]}]},
            "status": {"phase": phase, "podIP": draw(st.sampled_from(ADDRESSES)),
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


@st.composite
def endpoint_slices(draw: st.DrawFn) -> dict[str, Any]:
    endpoints = draw(st.lists(st.fixed_dictionaries({
        "addresses": st.lists(st.sampled_from(ADDRESSES), min_size=1, max_size=2, unique=True),
        "conditions": st.fixed_dictionaries({"ready": st.booleans()}),
        "targetRef": st.fixed_dictionaries({"kind": st.just("Pod"), "name": st.sampled_from(("p0", "p1", "p2"))}),
    }), max_size=3))
    return {"apiVersion": "discovery.k8s.io/v1",
            **_meta("EndpointSlice", f"s{draw(st.integers(0, 2))}", draw(namespaces),
                    labels={"kubernetes.io/service-name": draw(st.sampled_from(NAMES))}),
            "addressType": "IPv4", "ports": [{"name": draw(st.sampled_from(("http", "grpc"))), "port": 8081}],
            "endpoints": endpoints}


@st.composite
def service_entries(draw: st.DrawFn) -> dict[str, Any]:
    # "a.n1" is also a Kubernetes Service's short alias: the entry's host must win it, and give it back.
    hosts = draw(st.lists(st.sampled_from(("a.n1", "ext.example.com", "b.n2.svc.cluster.local")),
                          min_size=1, max_size=2, unique=True))
    spec: dict[str, Any] = {"hosts": hosts, "resolution": draw(st.sampled_from(("STATIC", "DNS"))),
                            "ports": [{"number": 443, "name": "tls", "protocol": "TLS"}]}
    if draw(st.booleans()):
        spec["workloadSelector"] = {"labels": {"app": draw(st.sampled_from(APPS))}}
    else:
        spec["endpoints"] = [{"address": a} for a in draw(st.lists(st.sampled_from(ADDRESSES), max_size=2, unique=True))]
    return {"apiVersion": "networking.istio.io/v1", **_meta("ServiceEntry", draw(st.sampled_from(("e1", "e2"))), "n1"),
            "spec": spec}


@st.composite
def workload_entries(draw: st.DrawFn) -> dict[str, Any]:
    return {"apiVersion": "networking.istio.io/v1", **_meta("WorkloadEntry", f"w{draw(st.integers(0, 1))}", "n1"),
            "spec": {"address": draw(st.sampled_from(ADDRESSES)), "labels": draw(labels),
                     "weight": draw(st.sampled_from((0, 3))),
                     "ports": draw(st.sampled_from(({}, {"http": 8082}, {"grpc": 7071})))}}


@st.composite
def destination_rules(draw: st.DrawFn) -> dict[str, Any]:
    return {"apiVersion": "networking.istio.io/v1", **_meta("DestinationRule", "r", draw(namespaces)),
            "spec": {"host": f"{draw(st.sampled_from(NAMES))}.n1.svc.cluster.local",
                     "trafficPolicy": {"loadBalancer": {"simple": draw(st.sampled_from(("ROUND_ROBIN", "RANDOM")))}}}}


def _others(draw: st.DrawFn) -> dict[str, Any]:
    """Kinds that touch every endpoint or storage: the builder's whole-build path and volumes."""
    return draw(st.sampled_from((
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1", "labels": {"topology.kubernetes.io/zone": "z1"}}},
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1", "labels": {"topology.kubernetes.io/zone": "z2"}}},
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1", "labels": {"topology.kubernetes.io/zone": "z2"}},
         "status": {"conditions": [{"type": "Ready", "status": "True"}]}},  # a status update: no locality moves
        {"apiVersion": "v1", **_meta("PersistentVolumeClaim", "data", "n1"), "spec": {"volumeName": "pv1"}},
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "pv1"}, "spec": {"capacity": {"storage": "1Gi"}}},
        tls_secret("cert", "n1", CREDENTIAL[1], CREDENTIAL[2]),
    )))


objects = st.one_of(services(), pods(), pods(), endpoint_slices(), service_entries(), workload_entries(),
                    destination_rules(), st.composite(_others)())
# An operation: write an object, or delete the object it names.
operations = st.tuples(st.sampled_from(("apply", "apply", "delete")), objects)
batches = st.lists(st.lists(operations, min_size=1, max_size=4), min_size=1, max_size=8)


def _key(raw: dict[str, Any]) -> ObjectKey:
    return ObjectKey(raw["kind"], raw["metadata"].get("namespace", ""), raw["metadata"]["name"])


def _assert_same(incremental: Snapshot, whole: Snapshot) -> None:
    assert dict(incremental.services) == dict(whole.services)
    assert dict(incremental.endpoints) == dict(whole.endpoints)
    assert dict(incremental.workloads) == dict(whole.workloads)
    assert dict(incremental.endpoint_slices) == dict(whole.endpoint_slices)
    assert incremental.config == whole.config
    assert incremental.volumes == whole.volumes
    assert dict(incremental.nodes) == dict(whole.nodes)
    assert dict(incremental.credentials) == dict(whole.credentials)
    assert isinstance(incremental.lookups, Lookups) and isinstance(whole.lookups, Lookups)
    assert dict(incremental.lookups.aliases) == dict(whole.lookups.aliases)
    assert dict(incremental.lookups.inbound) == dict(whole.lookups.inbound)
    assert dict(incremental.lookups.by_address) == dict(whole.lookups.by_address)
    assert isinstance(incremental.selection, Selection) and isinstance(whole.selection, Selection)
    assert {ns: dict(index) for ns, index in incremental.selection.labels.items()} == \
        {ns: dict(index) for ns, index in whole.selection.labels.items()}
    assert dict(incremental.selection.slices) == dict(whole.selection.slices)
    assert dict(incremental.selection.namespaces) == dict(whole.selection.namespaces)
    # The lookups as the generators call them.
    for host in ("a.n1", "a.n1.svc", "ext.example.com", "b.n2.svc.cluster.local", "c.n2", "missing"):
        assert incremental.service_for_host(host) == whole.service_for_host(host)
    for address in ADDRESSES:
        assert incremental.instances_on(address) == whole.instances_on(address)
        for port in (8080, 8081, 9090, 7070, 443):
            assert incremental.instances_at(address, port) == whole.instances_at(address, port)


def _pod(labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", **_meta("Pod", "p0", "n1", labels=labels), "spec": {"containers": []},
            "status": {"phase": "Running", "podIP": ADDRESSES[0], "conditions": [{"type": "Ready", "status": "True"}]}}


# A Pod alone changing under a ServiceEntry that selects it (picked, relabelled away, picked, gone):
# rare enough in the random batches that it is spelled out.
_PICKING_ENTRY = {"apiVersion": "networking.istio.io/v1", **_meta("ServiceEntry", "e1", "n1"),
                  "spec": {"hosts": ["ext.example.com"], "resolution": "STATIC",
                           "workloadSelector": {"labels": {"app": "a"}},
                           "ports": [{"number": 443, "name": "tls", "protocol": "TLS"}]}}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
@example([[("apply", _PICKING_ENTRY)], [("apply", _pod({"app": "a"}))], [("apply", _pod({"app": "b"}))],
          [("apply", _pod({"app": "a", "version": "b"}))], [("delete", _pod({}))]])
def test_incremental_build_equals_whole_build(steps: list[list[tuple[str, dict[str, Any]]]]) -> None:
    store = Store()
    changed: list[ObjectKey] = []
    store.subscribe(lambda change: changed.append(change.key))
    snapshot = build_snapshot(store, "v0")
    for number, batch in enumerate(steps, 1):
        for operation, raw in batch:
            if operation == "apply":
                store.apply(raw)
            else:
                store.delete(_key(raw))
        previous = snapshot
        snapshot = build_snapshot(store, f"v{number}", previous, list(changed))
        changed.clear()
        _assert_same(snapshot, build_snapshot(store, f"v{number}"))
        # What did not change stays the same object, for the caches that key on identity.
        for key, endpoints in snapshot.endpoints.items():
            if previous.endpoints.get(key) == endpoints:
                assert previous.endpoints[key] is endpoints

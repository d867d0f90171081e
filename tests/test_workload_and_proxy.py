from __future__ import annotations

import pytest

from istiod.model.proxy import NodeIdError, parse_node_id, proxy_from_node
from istiod.model.workload import OwnerRef, workload_identity

RS = OwnerRef("ReplicaSet", "reviews-v1-5b8f7c9d4", controller=True)


@pytest.mark.parametrize(
    ("pod", "labels", "owners", "expected"),
    [
        ("reviews-v1-5b8f7c9d4-x2k4p", {"pod-template-hash": "5b8f7c9d4"}, [RS], ("reviews-v1", "Deployment")),
        # Without the hash label Istio cannot tell a Deployment's ReplicaSet from a bare one.
        ("rs-pod", {}, [RS], ("reviews-v1-5b8f7c9d4", "ReplicaSet")),
        ("report-29412360-7xk2d", {}, [OwnerRef("Job", "report-29412360", True)], ("report", "CronJob")),
        ("once-abc", {}, [OwnerRef("Job", "once", True)], ("once", "Job")),
        ("short-1234567", {}, [OwnerRef("Job", "short-1234567", True)], ("short-1234567", "Job")),
        ("long-12345678901", {}, [OwnerRef("Job", "long-12345678901", True)], ("long-12345678901", "Job")),
        ("db-0", {}, [OwnerRef("StatefulSet", "db", True)], ("db", "StatefulSet")),
        ("bare", {}, [], ("bare", "Pod")),
        ("not-controller", {}, [OwnerRef("ReplicaSet", "x", False)], ("not-controller", "Pod")),
        ("labelled", {"service.istio.io/workload-name": "custom"}, [RS], ("custom", "ReplicaSet")),
    ],
)
def test_workload_identity(pod: str, labels: dict[str, str], owners: list[OwnerRef], expected: tuple[str, str]) -> None:
    assert workload_identity(pod, labels, owners) == expected


def test_parse_node_id() -> None:
    assert parse_node_id("sidecar~10.1.2.3~echo-1.demo~demo.svc.cluster.local") == (
        "sidecar", "10.1.2.3", "echo-1", "demo", "demo.svc.cluster.local",
    )
    assert parse_node_id("sidecar~::1~p.ns~ns.svc.cluster.local")[1] == "::1"


@pytest.mark.parametrize(
    ("node_id", "message"),
    [
        ("sidecar~10.1.2.3~echo-1.demo", "must have 4"),
        ("gateway~10.1.2.3~echo-1.demo~d", "unknown proxy type"),
        ("sidecar~not-an-ip~echo-1.demo~d", "is not an IP address"),
        ("sidecar~10.1.2.3~echo-1~d", "<pod>.<namespace>"),
        ("", "must have 4"),
    ],
)
def test_parse_node_id_errors(node_id: str, message: str) -> None:
    with pytest.raises(NodeIdError, match=message):
        parse_node_id(node_id)


def test_proxy_from_node_metadata() -> None:
    proxy = proxy_from_node(
        "sidecar~10.0.0.5~echo-1.demo~demo.svc.corp.example",
        {"GENERATOR": "grpc", "NAMESPACE": "demo", "SERVICE_ACCOUNT": "echo", "LABELS": {"app": "echo"},
         "WORKLOAD_NAME": "echo", "CLUSTER_ID": "c1", "INSTANCE_IPS": "10.0.0.5,fd00::5"},
    )
    assert proxy.proxyless and proxy.ip == "10.0.0.5" and proxy.ip_addresses == ("10.0.0.5", "fd00::5")
    assert (proxy.namespace, proxy.service_account, proxy.workload_name, proxy.cluster_id) == ("demo", "echo", "echo", "c1")
    assert proxy.labels == (("app", "echo"),) and proxy.domain == "corp.example"
    with pytest.raises(NodeIdError, match="LABELS"):
        proxy_from_node("sidecar~10.0.0.5~echo-1.demo~d", {"LABELS": "app=echo"})

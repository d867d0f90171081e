"""PersistentVolumes through the real API: capacity parsed exactly, and which workload mounts it."""

from __future__ import annotations

from collections.abc import Callable

from kubernetes_asyncio import client

from e2e.kube_objects import create_running_pod, ensure_namespace, pod_body
from tests.peers import Istiod, wait_until

NS = "e2e-storage"


async def test_volume_capacity_and_mounting_workload(
    kube: client.ApiClient, start_istiod_kube: Callable[..., Istiod]
) -> None:
    core = client.CoreV1Api(kube)
    await ensure_namespace(kube, NS)
    await core.create_persistent_volume({
        "metadata": {"name": "pv-e2e-data"},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "manual",
                 "hostPath": {"path": "/tmp/pv-e2e-data"}, "claimRef": {"namespace": NS, "name": "data"}},
    })
    await core.create_namespaced_persistent_volume_claim(NS, {
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "manual", "volumeName": "pv-e2e-data",
                 "resources": {"requests": {"storage": "10Gi"}}},
    })
    owner = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "db-5f6d7c8b9", "uid": "3f1c-e2e", "controller": True}
    await create_running_pod(kube, NS, pod_body("db-5f6d7c8b9-k2m4p", "db", 5432, owner=owner, claim="data",
                                                 labels={"pod-template-hash": "5f6d7c8b9"}), "127.0.0.71")
    istiod = start_istiod_kube()

    def mounts() -> list[dict]:
        status, workloads = istiod.get("/debug/instancesz")
        pod = next((w for w in workloads if w["name"] == "db-5f6d7c8b9-k2m4p"), None) if status == 200 else None
        return [{**v, "workload": (pod["workloadName"], pod["workloadKind"])} for v in pod["volumes"]] if pod else []

    (volume,) = wait_until(mounts, 10, "the pod's mounted volume")
    assert volume["persistentVolume"] == "pv-e2e-data" and volume["claim"] == "data"
    assert volume["capacity"] == "10Gi" and volume["capacityBytes"] == 10 * 2**30
    assert volume["accessModes"] == ["ReadWriteOnce"] and volume["workload"] == ("db", "Deployment")
    await core.delete_namespaced_pod("db-5f6d7c8b9-k2m4p", NS, grace_period_seconds=0)
    wait_until(lambda: not mounts(), 2, "the mount to go with the pod")

"""Jobs and CronJobs through the real API: workload names from owners, finished pods leave."""

from __future__ import annotations

from collections.abc import Callable

from kubernetes_asyncio import client

from e2e.kube_objects import create_running_pod, ensure_namespace, pod_body, service_body
from tests.peers import Istiod, wait_until

NS = "e2e-batch"
TEMPLATE = {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "demo/report"}]}}


def owner(kind: str, api_version: str, meta: client.V1ObjectMeta) -> dict[str, object]:
    return {"apiVersion": api_version, "kind": kind, "name": meta.name, "uid": meta.uid, "controller": True}


async def test_cronjob_workload_names_and_finished_pods(
    kube: client.ApiClient, start_istiod_kube: Callable[..., Istiod]
) -> None:
    core, batch = client.CoreV1Api(kube), client.BatchV1Api(kube)
    await ensure_namespace(kube, NS)
    await core.create_namespaced_service(NS, service_body("reports"))
    cron = await batch.create_namespaced_cron_job(
        NS, {"metadata": {"name": "nightly"}, "spec": {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": TEMPLATE}}}})
    scheduled = await batch.create_namespaced_job(NS, {
        "metadata": {"name": "nightly-29412360", "ownerReferences": [owner("CronJob", "batch/v1", cron.metadata)]},
        "spec": {"template": TEMPLATE}})
    adhoc = await batch.create_namespaced_job(NS, {"metadata": {"name": "adhoc"}, "spec": {"template": TEMPLATE}})
    for name, job, ip in (("nightly-29412360-x7k2d", scheduled, "127.0.0.61"), ("adhoc-q2w3e", adhoc, "127.0.0.62")):
        await create_running_pod(kube, NS, pod_body(name, "reports", 9000, owner=owner("Job", "batch/v1", job.metadata)), ip)
    istiod = start_istiod_kube()
    host = f"reports.{NS}.svc.cluster.local"

    def endpoints() -> dict[str, tuple[str, str]]:
        status, view = istiod.get("/debug/endpointz")
        return {e["pod"]: (e["workload"], e["workloadKind"]) for e in view.get(host, {}).get("7070", [])}

    wait_until(lambda: endpoints() == {"nightly-29412360-x7k2d": ("nightly", "CronJob"), "adhoc-q2w3e": ("adhoc", "Job")},
               10, "both batch pods as endpoints with their workload names")

    # The ad-hoc Job's pod completes: it leaves the endpoints.
    await core.patch_namespaced_pod_status("adhoc-q2w3e", NS, {"status": {
        "phase": "Succeeded", "conditions": [{"type": "Ready", "status": "False"}]}})
    wait_until(lambda: set(endpoints()) == {"nightly-29412360-x7k2d"}, 2, "the completed pod to leave")
    await core.delete_namespaced_service("reports", NS)

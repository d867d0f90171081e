"""`istiod cni` against a real kube-apiserver: its node's pods from the informers, the annotation
istiod reads (`ambient.istio.io/redirection: enabled`) written and cleared through the API, with the
real ztunnel taking the pods (tests/cni_node.py)."""

from __future__ import annotations

import asyncio

from kubernetes_asyncio import client

from e2e.harness import Cluster
from e2e.kube_objects import create_running_pod, ensure_namespace, pod_body
from tests.cni_node import INPOD_PORTS, NODE, CniNode, cni_node, up, ztunnel_binary  # noqa: F401
from tests.peers import eventually
from tests.pods import requires_root

pytestmark = requires_root
NS = "ambient-e2e"
ANNOTATION = "ambient.istio.io/redirection"


async def annotation(core: client.CoreV1Api, name: str) -> str | None:
    pod = await core.read_namespaced_pod(name, NS)
    return (pod.metadata.annotations or {}).get(ANNOTATION)


async def test_agent_annotates_captured_pods_through_the_api(cluster: Cluster, kube: client.ApiClient,
                                                            cni_node: CniNode) -> None:  # noqa: F811
    node, binary, core = cni_node, ztunnel_binary(), client.CoreV1Api(kube)
    await ensure_namespace(kube, NS, {"istio.io/dataplane-mode": "ambient"})
    node.add_pod("a", 2)
    node.add_pod("b", 3)
    for name, host, labels in (("a", 2, {}), ("b", 3, {"istio.io/dataplane-mode": "none"})):
        body = pod_body(name, name, 8080, labels=labels)
        body["spec"]["nodeName"] = NODE
        await create_running_pod(kube, NS, body, node.node.pod_ip(host))
    other = pod_body("elsewhere", "elsewhere", 8080)
    other["spec"]["nodeName"] = "node-2"
    await create_running_pod(kube, NS, other, "10.61.0.9")
    uid = (await core.read_namespaced_pod("a", NS)).metadata.uid

    await asyncio.to_thread(node.start_agent, "--kubeconfig", str(cluster.kubeconfig))
    node.start_ztunnel(binary)
    await eventually(lambda: up(node, uid), 30, "ztunnel to run pod a's proxy")
    await eventually(lambda: annotation(core, "a"), 15, "pod a annotated")
    assert await annotation(core, "a") == "enabled"
    assert await annotation(core, "b") is None and await annotation(core, "elsewhere") is None
    assert node.captured("a") and not node.captured("b")
    assert INPOD_PORTS <= node.listening("a")

    # Opting the pod out through the API: annotation cleared, rules removed, ztunnel told.
    await core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"istio.io/dataplane-mode": "none"}}})

    async def released() -> bool:
        return await annotation(core, "a") is None and not node.captured("a") and uid not in node.workload_state()

    await eventually(released, 15, "pod a released and its annotation cleared")

    # The pod deleted after joining again: ztunnel drops it.
    await core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"istio.io/dataplane-mode": "ambient"}}})
    await eventually(lambda: annotation(core, "a"), 15, "pod a annotated again")
    await core.delete_namespaced_pod("a", NS, grace_period_seconds=0)
    await eventually(lambda: uid not in node.workload_state() and not node.captured("a"), 15, "pod a released")

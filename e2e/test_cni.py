"""`istiod cni` against a real kube-apiserver, with istiod serving the real ztunnel: the agent reads
its node's pods from the informers, captures them and writes `ambient.istio.io/redirection: enabled`
through the API; istiod reads that annotation and sends each pod to ztunnel as HBONE (WDS), and a
call between two captured pods goes over HBONE (tests/cni_node.py has the node)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e.harness import Cluster
from e2e.kube_objects import ISTIO_NAMESPACE, create_running_pod, ensure_namespace, pod_body
from istiod.demo.pods import ISTIOD_IN_POD
from tests.cni_node import INPOD_PORTS, NODE, CniNode, cni_node, up  # noqa: F401
from tests.peers import Istiod, Process, eventually
from tests.pods import requires_root
from tests.ztunnel_peer import ztunnel_binary

pytestmark = requires_root
NS = "ambient-e2e"
ANNOTATION = "ambient.istio.io/redirection"


async def annotation(core: client.CoreV1Api, name: str) -> str | None:
    pod = await core.read_namespaced_pod(name, NS)
    return (pod.metadata.annotations or {}).get(ANNOTATION)


async def ztunnel_credentials(kube: client.ApiClient, workdir: Path) -> tuple[Path, Path]:
    """istio-system/ztunnel's token (as its pod would mount it) and istiod's root from the ConfigMap."""
    core = client.CoreV1Api(kube)
    try:
        await core.create_namespaced_service_account(ISTIO_NAMESPACE, {"metadata": {"name": "ztunnel"}})
    except ApiException as error:
        if error.status != 409:
            raise
    request = {"spec": {"audiences": ["istio-ca"], "expirationSeconds": 600}}
    token = (await core.create_namespaced_service_account_token("ztunnel", ISTIO_NAMESPACE, request)).status.token

    async def root() -> str | None:
        try:
            configmap = await core.read_namespaced_config_map("istio-ca-root-cert", ISTIO_NAMESPACE)
        except ApiException:
            return None
        return (configmap.data or {}).get("root-cert.pem")

    (workdir / "ztunnel-token").write_text(token)
    (workdir / "root-cert.pem").write_text(await eventually(root, 30, "istiod's root in istio-ca-root-cert"))
    return workdir / "ztunnel-token", workdir / "root-cert.pem"


def protocol(node: CniNode, name: str) -> str:
    """How ztunnel was told to reach pod `name` (by istiod's WDS): HBONE or TCP."""
    try:
        dump: dict[str, Any] = node.config_dump()
    except ValueError:
        return ""
    found = [w for w in dump.get("workloads") or [] if w.get("name") == name]
    return str(found[0].get("protocol")) if found else ""


async def test_istiod_sends_captured_pods_to_ztunnel_as_hbone(
        cluster: Cluster, kube: client.ApiClient, cni_node: CniNode,  # noqa: F811
        start_istiod_kube: Callable[..., Istiod], processes: list[Process]) -> None:
    node, binary, core = cni_node, ztunnel_binary(), client.CoreV1Api(kube)
    await ensure_namespace(kube, NS, {"istio.io/dataplane-mode": "ambient"})
    for name, host in (("a", 2), ("b", 3)):
        node.add_pod(name, host)
        body = pod_body(name, name, 8080)
        body["spec"]["nodeName"] = NODE
        await create_running_pod(kube, NS, body, node.node.pod_ip(host))
        node.start_echo(name, 8080)
    other = pod_body("elsewhere", "elsewhere", 8080)
    other["spec"]["nodeName"] = "node-2"
    await create_running_pod(kube, NS, other, "10.61.0.9")
    uid = (await core.read_namespaced_pod("a", NS)).metadata.uid

    istiod = await asyncio.to_thread(start_istiod_kube)
    token, root = await ztunnel_credentials(kube, node.tmp)
    # ztunnel reaches istiod's 15012 on the host's loopback through a tunnel into the node namespace.
    processes.append(Process([sys.executable, "-m", "istiod.demo.pods", "tunnel", "--netns", node.node.ns.name,
                              "--listen", ISTIOD_IN_POD, "--to", istiod.secure_address], name="tunnel"))
    await asyncio.to_thread(node.start_agent, "--kubeconfig", str(cluster.kubeconfig))
    ztunnel = node.start_ztunnel(binary, xds={"XDS_ADDRESS": f"https://{ISTIOD_IN_POD}", "XDS_ROOT_CA": str(root),
                                    "AUTH_TOKEN": str(token), "CLUSTER_ID": "Kubernetes"})

    await eventually(lambda: up(node, uid), 60, "ztunnel to run pod a's proxy")
    await eventually(lambda: annotation(core, "a"), 15, "pod a annotated")
    assert await annotation(core, "a") == "enabled"
    assert await annotation(core, "elsewhere") is None  # another node's pod: not this agent's
    assert node.captured("a") and node.captured("b") and INPOD_PORTS <= node.listening("a")
    await eventually(lambda: protocol(node, "a") == "HBONE" and protocol(node, "b") == "HBONE", 15,
                     "istiod's WDS to send both pods as HBONE")
    a, b = node.node.pod_ip(2), node.node.pod_ip(3)
    assert f'"{b}:8080"' in node.call("a", b, 8080)
    await eventually(lambda: any("connection complete" in line and f"dst.hbone_addr={b}:8080" in line
                                 and "error=" not in line for line in ztunnel.output), 5,
                     "ztunnel's access log of a's call to b over HBONE")

    # Opting pod a out through the API: annotation cleared (istiod sends it as TCP again), rules
    # removed, ztunnel told.
    await core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"istio.io/dataplane-mode": "none"}}})

    async def released() -> bool:
        return (await annotation(core, "a") is None and not node.captured("a") and uid not in node.workload_state()
                and protocol(node, "a") == "TCP")

    await eventually(released, 15, "pod a released, its annotation cleared and istiod sending it as TCP")

    # Back in, then deleted: ztunnel drops it.
    await core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"istio.io/dataplane-mode": "ambient"}}})
    await eventually(lambda: annotation(core, "a"), 15, "pod a annotated again")
    await core.delete_namespaced_pod("a", NS, grace_period_seconds=0)
    await eventually(lambda: uid not in node.workload_state() and not node.captured("a"), 15, "pod a released")

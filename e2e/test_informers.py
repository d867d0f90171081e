"""istiod against a real kube-apiserver + etcd: a real grpcio xDS client follows the cluster."""

from __future__ import annotations

from collections.abc import Callable

from kubernetes_asyncio import client

from e2e.kube_objects import create_running_pod, echo_service, ensure_namespace, pod_body, service_body, slice_body
from tests.peers import Istiod, Process, wait_until
from tests.test_proxyless_grpc import start_client, wait_for_replies

NS = "e2e-mesh"


async def test_client_follows_pods(
    kube: client.ApiClient, start_istiod_kube: Callable[..., Istiod], start_demo: Callable[..., Process]
) -> None:
    """Endpoints from the pods the Service selects: the API refuses loopback addresses in
    EndpointSlices, so traffic tests use pods (127.0.0.x) and no slices, and slices are tested
    with documentation addresses in test_endpoint_slices."""
    core = client.CoreV1Api(kube)
    await ensure_namespace(kube, NS)
    ips = {"echo-a": "127.0.0.41", "echo-b": "127.0.0.42"}
    port = await echo_service(kube, start_demo, NS, "echo", ips)
    istiod = start_istiod_kube()
    client_proc = start_client(start_demo, istiod, f"xds:///echo.{NS}.svc.cluster.local:7070", NS)
    wait_until(lambda: any(l["ok"] for l in client_proc.drain()), 20, "a first reply through istiod")

    await create_running_pod(kube, NS, pod_body("echo-b", "echo", port), ips["echo-b"])
    print(f"scale up seen in {wait_for_replies(client_proc, {'echo-a', 'echo-b'}):.2f}s")

    await core.delete_namespaced_pod("echo-a", NS, grace_period_seconds=0)
    print(f"scale down seen in {wait_for_replies(client_proc, {'echo-b'}):.2f}s")

    await core.delete_namespaced_service("echo", NS)
    wait_for_replies(client_proc, {"UNAVAILABLE"})
    assert "does not exist" in client_proc.next_json(5)["error"]


async def test_endpoint_slices(kube: client.ApiClient, start_istiod_kube: Callable[..., Istiod]) -> None:
    """Slices win over selected pods, and follow the slice: 192.0.2.0/24 is never dialled."""
    core, discovery = client.CoreV1Api(kube), client.DiscoveryV1Api(kube)
    await ensure_namespace(kube, NS)
    await core.create_namespaced_service(NS, service_body("sliced"))
    await create_running_pod(kube, NS, pod_body("sliced-1", "sliced", 8080), "127.0.0.43")
    await discovery.create_namespaced_endpoint_slice(
        NS, slice_body("sliced-a", "sliced", 8080, [("192.0.2.1", "sliced-1"), ("192.0.2.2", "")]))
    istiod = start_istiod_kube()
    host = f"sliced.{NS}.svc.cluster.local"

    def addresses() -> list[str]:
        status, view = istiod.get("/debug/endpointz")
        return sorted(e["address"] for e in view.get(host, {}).get("7070", [])) if status == 200 else []

    wait_until(lambda: addresses() == ["192.0.2.1", "192.0.2.2"], 10, "the slice's endpoints")
    await discovery.create_namespaced_endpoint_slice(NS, slice_body("sliced-b", "sliced", 8080, [("192.0.2.3", "")]))
    wait_until(lambda: addresses() == ["192.0.2.1", "192.0.2.2", "192.0.2.3"], 2, "a second slice")
    await discovery.delete_namespaced_endpoint_slice("sliced-a", NS)
    wait_until(lambda: addresses() == ["192.0.2.3"], 2, "the first slice's deletion")
    await core.delete_namespaced_service("sliced", NS)


async def test_discovery_selectors(kube: client.ApiClient, start_istiod_kube: Callable[..., Istiod]) -> None:
    """Only namespaces whose labels match are read; labelling one in or out moves its services."""
    core = client.CoreV1Api(kube)
    await ensure_namespace(kube, "e2e-seen", {"istio-discovery": "enabled"})
    await ensure_namespace(kube, "e2e-unseen")
    for namespace in ("e2e-seen", "e2e-unseen"):
        await core.create_namespaced_service(namespace, service_body("selected"))
    istiod = start_istiod_kube("--discovery-selector", "istio-discovery=enabled")

    def namespaces() -> set[str]:
        status, services = istiod.get("/debug/registryz")
        return {s["Attributes"]["Namespace"] for s in services if s["Attributes"]["Name"] == "selected"}

    wait_until(lambda: namespaces() == {"e2e-seen"}, 5, "only the labelled namespace")
    await core.patch_namespace("e2e-unseen", {"metadata": {"labels": {"istio-discovery": "enabled"}}})
    wait_until(lambda: namespaces() == {"e2e-seen", "e2e-unseen"}, 2, "the newly labelled namespace")
    await core.patch_namespace("e2e-seen", {"metadata": {"labels": {"istio-discovery": None}}})
    wait_until(lambda: namespaces() == {"e2e-unseen"}, 2, "the unlabelled namespace to leave")

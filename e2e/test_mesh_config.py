"""The mesh config from the ConfigMap `istio` (key `mesh`) in istiod's namespace, on a real
kube-apiserver: discoverySelectors with matchExpressions applied, then changed, without a restart."""

from __future__ import annotations

from collections.abc import Callable

from kubernetes_asyncio import client

from e2e.kube_objects import ISTIO_NAMESPACE, ensure_namespace, service_body
from tests.peers import Istiod, wait_until

MESH = """discoverySelectors:
- matchExpressions: [{key: team, operator: In, values: [%s]}]
"""


async def test_discovery_selectors_from_the_configmap(kube: client.ApiClient,
                                                      start_istiod_kube: Callable[..., Istiod]) -> None:
    core = client.CoreV1Api(kube)
    await ensure_namespace(kube, ISTIO_NAMESPACE)
    for namespace, team in (("e2e-team-a", "a"), ("e2e-team-b", "b")):
        await ensure_namespace(kube, namespace, {"team": team})
        await core.create_namespaced_service(namespace, service_body("teamed"))
    configmap = {"metadata": {"name": "istio", "namespace": ISTIO_NAMESPACE}, "data": {"mesh": MESH % "a"}}
    await core.create_namespaced_config_map(ISTIO_NAMESPACE, configmap)
    try:
        istiod = start_istiod_kube()

        def namespaces() -> set[str]:
            status, services = istiod.get("/debug/registryz")
            return {s["Attributes"]["Namespace"] for s in services if s["Attributes"]["Name"] == "teamed"}

        wait_until(lambda: namespaces() == {"e2e-team-a"}, 10, "only team a's namespace, from the first read")
        await core.patch_namespaced_config_map("istio", ISTIO_NAMESPACE, {"data": {"mesh": MESH % "a, b"}})
        wait_until(lambda: namespaces() == {"e2e-team-a", "e2e-team-b"}, 10, "team b added without a restart")
        await core.patch_namespaced_config_map("istio", ISTIO_NAMESPACE, {"data": {"mesh": "rootNamespace: [\n"}})
        wait_until(lambda: "keeping the last good mesh config" in istiod.log(), 10, "a bad edit refused")
        assert namespaces() == {"e2e-team-a", "e2e-team-b"}
    finally:
        await core.delete_namespaced_config_map("istio", ISTIO_NAMESPACE)

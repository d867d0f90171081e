"""Automated deployment on a real kube-apiserver with the Gateway API's CRDs: for a Gateway of class
`istio`, the leader creates Istio's ServiceAccount, Deployment and Service `<gateway>-istio` (labels,
owner references, ports from the listeners), follows a listener's port, addresses the Gateway with
the Service, and removes them when the Gateway is deleted (this API server has no garbage
collector: istiod deletes them itself). A Gateway annotated gateway.istio.io/name-override and
gateway.istio.io/service-account gets objects of those names; a waypoint Gateway gets Istio's waypoint
objects; a Gateway whose spec.addresses names a Service is run by that Service and not deployed. While
another replica holds the lock, istiod writes nothing.
istiod runs as its own ServiceAccount under exactly deploy/rbac/istiod.yaml."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from e2e.gateway_api_crds import install_gateway_api_crds
from e2e.harness import Cluster
from e2e.kube_objects import another_replica_leading, create_running_pod, ensure_namespace, pod_body
from e2e.test_analysis_status import FAST
from e2e.test_rbac import istiod_kubeconfig
from istiod.ca.publisher import ELECTION
from tests.peers import Istiod, Process, eventually

GROUP, VERSION = "gateway.networking.k8s.io", "v1"
NS, NAME = "gw-deploy", "edge-istio"
GATEWAY_NAME = "gateway.networking.k8s.io/gateway-name"


async def _objects(kube: client.ApiClient, name: str = NAME, account: str = NAME) -> dict[str, Any]:
    """The Gateway's ServiceAccount, Deployment and Service that exist, by kind."""
    core, apps = client.CoreV1Api(kube), client.AppsV1Api(kube)
    found: dict[str, Any] = {}
    for kind, read, named in (("ServiceAccount", core.read_namespaced_service_account, account),
                              ("Deployment", apps.read_namespaced_deployment, name),
                              ("Service", core.read_namespaced_service, name)):
        with contextlib.suppress(client.ApiException):
            found[kind] = await read(named, NS)
    return found


async def test_the_leader_deploys_a_gateway_and_removes_it(cluster: Cluster, kube: client.ApiClient, tmp_path: Path,
                                                            processes: list[Process]) -> None:
    await install_gateway_api_crds(kube)
    await ensure_namespace(kube, NS)
    custom = client.CustomObjectsApi(kube)
    gateway = await custom.create_namespaced_custom_object(GROUP, VERSION, NS, "gateways", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Gateway", "metadata": {"name": "edge"},
        "spec": {"gatewayClassName": "istio",
                 "infrastructure": {"labels": {"team": "edge"}, "annotations": {"owner": "edge-team"}},
                 "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}]}})
    uid = gateway["metadata"]["uid"]
    await custom.create_namespaced_custom_object(GROUP, VERSION, NS, "gateways", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Gateway", "metadata": {"name": "named", "annotations": {
            "gateway.istio.io/name-override": "front", "gateway.istio.io/service-account": "front-sa"}},
        "spec": {"gatewayClassName": "istio", "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}]}})

    # Another replica holds the writers' lock: istiod must write nothing while it does.
    async with another_replica_leading(kube, ELECTION):
        kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
        istiod = await asyncio.to_thread(Istiod, tmp_path, "--kubeconfig", str(kubeconfig), *FAST, ready_timeout=60)
        processes.append(istiod)
        await asyncio.sleep(5)  # several passes and lease renewals
        assert await _objects(kube) == {} and await _objects(kube, "front", "front-sa") == {}, \
            "a replica that does not lead wrote"

    async def all_three() -> dict[str, Any] | None:
        found = await _objects(kube)
        return found if len(found) == 3 else None

    try:
        found = await eventually(all_three, 30, "the Gateway's ServiceAccount, Deployment and Service", interval=0.25)
    except AssertionError:
        print(istiod.text())
        raise
    for kind, obj in found.items():
        labels = obj.metadata.labels
        assert labels[GATEWAY_NAME] == "edge" and labels["gateway.networking.k8s.io/gateway-class-name"] == "istio"
        assert labels["team"] == "edge" and obj.metadata.annotations == {"owner": "edge-team"}, kind
        [owner] = obj.metadata.owner_references
        assert (owner.api_version, owner.kind, owner.name, owner.uid) == (f"{GROUP}/v1", "Gateway", "edge", uid)
    deployment, service = found["Deployment"], found["Service"]
    assert deployment.metadata.labels["gateway.istio.io/managed"] == "istio.io-gateway-controller"
    pod = deployment.spec.template
    assert pod.metadata.labels[GATEWAY_NAME] == "edge" and pod.spec.service_account_name == NAME
    assert pod.spec.containers[0].args[3:5] == ["proxy", "router"]
    assert [(p.name, p.port) for p in service.spec.ports] == [("status-port", 15021), ("http", 80)]
    print("deployed:", {k: v.metadata.name for k, v in found.items()}, "ports", [p.port for p in service.spec.ports])

    # Named by the Gateway's annotations, as istiod's DeploymentName and ServiceAccount.
    async def all_three_named() -> dict[str, Any] | None:
        found = await _objects(kube, "front", "front-sa")
        return found if len(found) == 3 else None

    named = await eventually(all_three_named, 30, "the annotated Gateway's objects", interval=0.25)
    assert named["Deployment"].spec.template.spec.service_account_name == "front-sa"
    assert all(o.metadata.owner_references[0].name == "named" for o in named.values())
    await custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "gateways", "named")

    async def named_gone() -> bool:
        return await _objects(kube, "front", "front-sa") == {}

    await eventually(named_gone, 30, "the annotated Gateway's objects removed", interval=0.25)
    print("name-override/service-account: deployed as front/front-sa, removed with the Gateway")

    # A waypoint (class istio-waypoint): Istio's waypoint.yaml objects, named as the Gateway.
    await custom.create_namespaced_custom_object(GROUP, VERSION, NS, "gateways", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Gateway", "metadata": {"name": "waypoint"},
        "spec": {"gatewayClassName": "istio-waypoint",
                 "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]}})

    async def waypoint_objects() -> dict[str, Any] | None:
        found = await _objects(kube, "waypoint", "waypoint")
        return found if len(found) == 3 else None

    made = await eventually(waypoint_objects, 30, "the waypoint's ServiceAccount, Deployment and Service", interval=0.25)
    assert all(o.metadata.labels["gateway.networking.k8s.io/gateway-class-name"] == "istio-waypoint"
               and o.metadata.owner_references[0].name == "waypoint" for o in made.values())
    waypoint_pod = made["Deployment"].spec.template
    assert made["Deployment"].metadata.labels["gateway.istio.io/managed"] == "istio.io-mesh-controller"
    assert waypoint_pod.metadata.labels["istio.io/dataplane-mode"] == "none"
    assert waypoint_pod.spec.containers[0].args[3:5] == ["proxy", "waypoint"]
    assert made["Service"].spec.type == "ClusterIP"
    assert [(p.name, p.port) for p in made["Service"].spec.ports] == [("status-port", 15021), ("mesh", 15008)]
    await custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "gateways", "waypoint")

    async def waypoint_gone() -> bool:
        return await _objects(kube, "waypoint", "waypoint") == {}

    await eventually(waypoint_gone, 30, "the waypoint's objects removed", interval=0.25)
    print("istio-waypoint: deployed as waypoint (ClusterIP, 15021 and 15008), removed with the Gateway")

    # The deployment's pod answering: the Gateway is Programmed with the Service's address.
    await create_running_pod(kube, NS, pod_body("edge-1", "edge", 80, labels={GATEWAY_NAME: "edge"}), "10.244.0.90")

    async def addressed() -> list[Any] | None:
        body = await custom.get_namespaced_custom_object(GROUP, VERSION, NS, "gateways", "edge")
        return (body.get("status") or {}).get("addresses")

    addresses = await eventually(addressed, 30, "the Gateway's addresses", interval=0.25)
    assert addresses == [{"type": "IPAddress", "value": service.spec.cluster_ip}], addresses

    # A listener's port edited: the Service follows.
    merge: dict[str, Any] = {"_content_type": "application/merge-patch+json"}  # the client's default is a JSON patch
    await custom.patch_namespaced_custom_object(GROUP, VERSION, NS, "gateways", "edge", {
        "spec": {"listeners": [{"name": "http", "port": 8080, "protocol": "HTTP"}]}}, **merge)

    async def moved() -> bool:
        service = await client.CoreV1Api(kube).read_namespaced_service(NAME, NS)
        return [(p.name, p.port) for p in service.spec.ports] == [("status-port", 15021), ("http", 8080)]

    await eventually(moved, 30, "the Service on the listener's new port", interval=0.25)
    print("listener port 80 -> 8080: the Service follows")

    # The Gateway deleted: istiod removes what it made (no garbage collector here).
    await custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "gateways", "edge")

    async def gone() -> bool:
        return await _objects(kube) == {}

    await eventually(gone, 30, "the Gateway's objects removed", interval=0.25)

    # spec.addresses naming a Service: a manual deployment, run by that Service's pods; nothing deployed.
    core = client.CoreV1Api(kube)
    manual = await core.create_namespaced_service(NS, {"metadata": {"name": "manual-gw"}, "spec": {
        "selector": {"app": "manual"}, "ports": [{"name": "http", "port": 80}]}})
    await custom.create_namespaced_custom_object(GROUP, VERSION, NS, "gateways", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Gateway", "metadata": {"name": "manual"},
        "spec": {"gatewayClassName": "istio", "addresses": [{"type": "Hostname", "value": "manual-gw"}],
                 "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}]}})
    await create_running_pod(kube, NS, pod_body("manual-1", "manual", 80, labels={"app": "manual"}), "10.244.0.91")

    async def manual_addressed() -> list[Any] | None:
        body = await custom.get_namespaced_custom_object(GROUP, VERSION, NS, "gateways", "manual")
        return (body.get("status") or {}).get("addresses")

    addresses = await eventually(manual_addressed, 30, "the manual Gateway's addresses", interval=0.25)
    assert addresses == [{"type": "IPAddress", "value": manual.spec.cluster_ip}], addresses
    assert await _objects(kube, "manual-istio", "manual-istio") == {}  # not deployed by istiod
    print("spec.addresses Hostname manual-gw: Programmed with", addresses, "and nothing deployed")


PARAMS_NS = "gw-params"


async def test_parameters_ref_and_class_defaults_customize_what_is_deployed(
        cluster: Cluster, kube: client.ApiClient, tmp_path: Path, processes: list[Process]) -> None:
    """spec.infrastructure.parametersRef, as istiod: the Gateway is refused (InvalidParameters) until its
    ConfigMap exists, then deployed with its overlays on top of the class's defaults (a ConfigMap of
    istiod's namespace labelled gateway.istio.io/defaults-for-class), an autoscaler and a disruption
    budget made because overlays ask for them; an overlay istiod cannot apply keeps what was deployed;
    deleting the Gateway removes all five."""
    await install_gateway_api_crds(kube)
    await ensure_namespace(kube, PARAMS_NS)
    core, apps = client.CoreV1Api(kube), client.AppsV1Api(kube)
    autoscaling, policy = client.AutoscalingV2Api(kube), client.PolicyV1Api(kube)
    custom = client.CustomObjectsApi(kube)
    defaults = await core.create_namespaced_config_map("istio-system", {
        "metadata": {"name": "params-test-defaults", "labels": {"gateway.istio.io/defaults-for-class": "istio"}},
        "data": {"podDisruptionBudget": "spec:\n  minAvailable: 1\n",
                 "deployment": "spec:\n  template:\n    spec:\n      containers:\n      - name: istio-proxy\n"
                               "        env:\n        - {name: FROM_DEFAULTS, value: 'yes'}\n"}})
    try:
        await custom.create_namespaced_custom_object(GROUP, VERSION, PARAMS_NS, "gateways", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "Gateway", "metadata": {"name": "tuned"},
            "spec": {"gatewayClassName": "istio",
                     "infrastructure": {"parametersRef": {"group": "", "kind": "ConfigMap", "name": "tuned-params"}},
                     "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}]}})
        kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
        istiod = await asyncio.to_thread(Istiod, tmp_path, "--kubeconfig", str(kubeconfig), *FAST, ready_timeout=60)
        processes.append(istiod)

        async def accepted() -> tuple[str, str, str] | None:
            body = await custom.get_namespaced_custom_object(GROUP, VERSION, PARAMS_NS, "gateways", "tuned")
            found = next((c for c in (body.get("status") or {}).get("conditions") or []
                          if c["type"] == "Accepted" and c.get("observedGeneration")), None)
            return None if found is None else (found["status"], found["reason"], found["message"])

        refused = ("False", "InvalidParameters", f"parametersRef ConfigMap {PARAMS_NS}/tuned-params does not exist")
        await eventually(lambda: _is(accepted, refused), 30, "Accepted False InvalidParameters", interval=0.25)
        await eventually(lambda: "gateway not deployed" in istiod.text(), 10, "the refusal logged")
        with contextlib.suppress(client.ApiException):
            await apps.read_namespaced_deployment("tuned-istio", PARAMS_NS)
            raise AssertionError("deployed without its parameters")
        print("parametersRef to a missing ConfigMap:", refused)

        await core.create_namespaced_config_map(PARAMS_NS, {"metadata": {"name": "tuned-params"}, "data": {
            "deployment": "metadata:\n  annotations: {tuned: 'true'}\nspec:\n  replicas: 2\n  template:\n    spec:\n"
                          "      containers:\n      - name: istio-proxy\n        resources:\n          limits: {cpu: 500m}\n",
            "service": "spec:\n  type: ClusterIP\n",
            "horizontalPodAutoscaler": "spec:\n  minReplicas: 2\n  maxReplicas: 4\n"}})

        async def deployed() -> dict[str, Any] | None:
            try:
                return {"Deployment": await apps.read_namespaced_deployment("tuned-istio", PARAMS_NS),
                        "Service": await core.read_namespaced_service("tuned-istio", PARAMS_NS),
                        "HorizontalPodAutoscaler": await autoscaling.read_namespaced_horizontal_pod_autoscaler(
                            "tuned-istio", PARAMS_NS),
                        "PodDisruptionBudget": await policy.read_namespaced_pod_disruption_budget("tuned-istio", PARAMS_NS)}
            except client.ApiException:
                return None

        found = await eventually(deployed, 30, "the Gateway's five objects", interval=0.25)
        deployment = found["Deployment"]
        assert deployment.spec.replicas == 2 and deployment.metadata.annotations["tuned"] == "true"
        [proxy] = deployment.spec.template.spec.containers
        assert proxy.resources.limits == {"cpu": "500m"}
        assert any(e.name == "FROM_DEFAULTS" and e.value == "yes" for e in proxy.env)
        assert any(e.name == "CA_ADDR" for e in proxy.env)  # the template's own, merged with the overlay's
        assert found["Service"].spec.type == "ClusterIP"
        autoscaler = found["HorizontalPodAutoscaler"]
        assert (autoscaler.spec.min_replicas, autoscaler.spec.max_replicas) == (2, 4)
        assert autoscaler.spec.scale_target_ref.name == "tuned-istio"
        assert found["PodDisruptionBudget"].spec.min_available == 1
        for obj in found.values():
            assert obj.metadata.owner_references[0].name == "tuned"
        await eventually(lambda: _is(accepted, ("True", "Accepted", "Resource accepted")), 30, "Accepted True",
                         interval=0.25)
        print("deployed with overlays: replicas", deployment.spec.replicas, "HPA", autoscaler.spec.min_replicas, "-",
              autoscaler.spec.max_replicas, "PDB minAvailable", found["PodDisruptionBudget"].spec.min_available)

        # An overlay istiod cannot apply: one line naming the Gateway; what was deployed stays.
        await core.patch_namespaced_config_map("tuned-params", PARAMS_NS, {"data": {"pod": "spec: {}"}})
        await eventually(lambda: "unsupported overlay 'pod'" in istiod.text(), 30, "the bad overlay logged")
        assert (await apps.read_namespaced_deployment("tuned-istio", PARAMS_NS)).spec.replicas == 2

        await custom.delete_namespaced_custom_object(GROUP, VERSION, PARAMS_NS, "gateways", "tuned")

        async def gone() -> bool:
            for read in (apps.read_namespaced_deployment, core.read_namespaced_service,
                         autoscaling.read_namespaced_horizontal_pod_autoscaler, policy.read_namespaced_pod_disruption_budget):
                try:
                    await read("tuned-istio", PARAMS_NS)
                    return False
                except client.ApiException:
                    pass
            return True

        await eventually(gone, 30, "the Gateway's objects removed", interval=0.25)
    finally:
        await core.delete_namespaced_config_map(defaults.metadata.name, "istio-system")


async def _is(read: Any, wanted: Any) -> bool:
    return await read() == wanted

"""Waypoints on a real kube-apiserver: istiod creates the GatewayClass `istio-waypoint` and accepts it,
writes a waypoint Gateway's status as Istio does (Programmed once its Service has endpoints, with its
cluster IP and hostname as addresses), and a ztunnel's WDS (a delta client as ztunnel's) then has
the waypoint on the Services that use it: one of the waypoint's namespace (the namespace's
`istio.io/use-waypoint`) and one of another namespace (`istio.io/use-waypoint-namespace`, admitted
by the listener's `allowedRoutes`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import json_format, struct_pb2
from kubernetes_asyncio import client

from e2e.gateway_api_crds import install_gateway_api_crds
from e2e.harness import Cluster
from e2e.kube_objects import create_running_pod, ensure_namespace, pod_body
from e2e.test_gateway_api import GROUP, VERSION, _conditions, _status, _wait
from e2e.test_rbac import istiod_kubeconfig
from istiod.gen.istio.workload import workload_pb2
from tests.peers import Istiod, Process

ADDRESS = "type.googleapis.com/istio.workload.Address"
NODE = "ztunnel~10.244.0.1~ztunnel-x.istio-system~istio-system.svc.cluster.local"
WAYPOINT = {"hostname": {"namespace": "wp-app", "hostname": "waypoint.wp-app.svc.cluster.local"},
            "hboneMtlsPort": 15008}


async def _services_with_waypoints(address: str, wanted: set[str], timeout: float = 30) -> dict[str, Any]:
    """The Services of a ztunnel's WDS (wildcard, ACKing) once each of `wanted` has a waypoint."""
    requests: asyncio.Queue[discovery_pb2.DeltaDiscoveryRequest] = asyncio.Queue()

    async def stream() -> AsyncIterator[discovery_pb2.DeltaDiscoveryRequest]:
        while True:
            yield await requests.get()

    metadata = struct_pb2.Struct()
    metadata.update({"NAMESPACE": "istio-system", "NODE_NAME": "node-a"})
    requests.put_nowait(discovery_pb2.DeltaDiscoveryRequest(node=base_pb2.Node(id=NODE, metadata=metadata),
                                                            type_url=ADDRESS))
    services: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources(stream())
        try:
            async with asyncio.timeout(timeout):
                while not all("waypoint" in services.get(name, {}) for name in wanted):
                    response = await call.read()
                    assert isinstance(response, discovery_pb2.DeltaDiscoveryResponse)
                    for resource in response.resources:
                        found = json_format.MessageToDict(workload_pb2.Address.FromString(resource.resource.value))
                        if "service" in found:
                            services[resource.name] = found["service"]
                    requests.put_nowait(discovery_pb2.DeltaDiscoveryRequest(type_url=ADDRESS,
                                                                            response_nonce=response.nonce))
        except TimeoutError:
            raise AssertionError(f"waypoints on {sorted(wanted)} within {timeout}s; services: {services}") from None
        finally:
            call.cancel()
    return services


async def test_a_waypoint_is_accepted_programmed_and_sent_to_ztunnel(cluster: Cluster, kube: client.ApiClient,
                                                                    tmp_path: Path, processes: list[Process]) -> None:
    await install_gateway_api_crds(kube)
    kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    custom, core = client.CustomObjectsApi(kube), client.CoreV1Api(kube)
    await ensure_namespace(kube, "wp-app")
    await core.patch_namespace("wp-app", {"metadata": {"labels": {"istio.io/dataplane-mode": "ambient",
                                                                  "istio.io/use-waypoint": "waypoint"}}})
    await ensure_namespace(kube, "wp-other")
    await core.create_namespaced_service("wp-app", {"metadata": {"name": "echo"}, "spec": {
        "selector": {"app": "echo"}, "ports": [{"name": "http", "port": 80}]}})
    await core.create_namespaced_service("wp-other", {"metadata": {"name": "web", "labels": {
        "istio.io/use-waypoint": "waypoint", "istio.io/use-waypoint-namespace": "wp-app"}}, "spec": {
        "selector": {"app": "web"}, "ports": [{"name": "http", "port": 80}]}})
    # The Gateway's Service, named after it, made before istiod runs (istiod then applies its own over it).
    await core.create_namespaced_service("wp-app", {"metadata": {"name": "waypoint", "labels": {
        "gateway.istio.io/managed": "istio.io-mesh-controller"}}, "spec": {
        "selector": {"gateway.networking.k8s.io/gateway-name": "waypoint"}, "ports": [{"name": "mesh", "port": 15008}]}})
    await custom.create_namespaced_custom_object(GROUP, VERSION, "wp-app", "gateways", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Gateway", "metadata": {"name": "waypoint"},
        "spec": {"gatewayClassName": "istio-waypoint", "listeners": [
            {"name": "mesh", "port": 15008, "protocol": "HBONE", "allowedRoutes": {"namespaces": {"from": "All"}}}]}})
    istiod = Istiod(tmp_path, "--kubeconfig", str(kubeconfig), "--leader-lease-duration", "2s",
                    "--leader-renew-deadline", "1.5s", "--leader-retry-period", "0.25s", ready_timeout=60)
    processes.append(istiod)

    async def class_accepted() -> dict[str, Any] | None:
        status = await _status(custom, "gatewayclasses", "", "istio-waypoint")
        return status if _conditions(status["conditions"])["Accepted"] == ("True", "Accepted") else None

    print("GatewayClass istio-waypoint:", await _wait(class_accepted, "istio-waypoint created and Accepted"))
    body = await custom.get_cluster_custom_object(GROUP, VERSION, "gatewayclasses", "istio-waypoint")
    assert body["spec"]["controllerName"] == "istio.io/mesh-controller"

    await create_running_pod(kube, "wp-app", pod_body("waypoint-1", "waypoint", 15008, labels={
        "gateway.networking.k8s.io/gateway-name": "waypoint"}), "10.244.0.90")

    async def programmed() -> dict[str, Any] | None:
        status = await _status(custom, "gateways", "wp-app", "waypoint")
        return status if _conditions(status["conditions"])["Programmed"] == ("True", "Programmed") else None

    gateway = await _wait(programmed, "the waypoint Gateway Programmed")
    print("Gateway waypoint:", gateway)
    service = await core.read_namespaced_service("waypoint", "wp-app")
    assert gateway["addresses"] == [{"type": "IPAddress", "value": service.spec.cluster_ip},
                                    {"type": "Hostname", "value": "waypoint.wp-app.svc.cluster.local"}]
    assert _conditions(gateway["listeners"][0]["conditions"])["Accepted"] == ("True", "Accepted")

    services = await _services_with_waypoints(istiod.xds_address, {"wp-app/echo.wp-app.svc.cluster.local",
                                                                    "wp-other/web.wp-other.svc.cluster.local"})
    assert services["wp-app/echo.wp-app.svc.cluster.local"]["waypoint"] == WAYPOINT
    assert services["wp-other/web.wp-other.svc.cluster.local"]["waypoint"] == WAYPOINT
    assert "waypoint" not in services["wp-app/waypoint.wp-app.svc.cluster.local"]

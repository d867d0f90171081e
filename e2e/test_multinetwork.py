"""Multi-network on a real kube-apiserver: meshNetworks from the ConfigMap `istio` key
`meshNetworks` (its gateways replace another network's endpoints in EDS, an edit re-pushes without
a restart), and a gateway Service labelled with its network, reached at its LoadBalancer status IP."""

from __future__ import annotations

from collections.abc import Callable

from envoy.config.endpoint.v3 import endpoint_pb2
from kubernetes_asyncio import client

from e2e.istio_crds import create_istio_object, install_crds
from e2e.kube_objects import ISTIO_NAMESPACE, ensure_namespace
from istiod.xds import types
from tests.ads_client import AdsClient
from tests.peers import Istiod, wait_until

NAMESPACE = "e2e-multinetwork"
HOST = f"echo.{NAMESPACE}.svc.cluster.local"
CLUSTER = f"outbound|80||{HOST}"
NETWORKS = "networks:\n  n2:\n    gateways:\n    - {address: %s, port: 15443}\n"


def _addresses(response: object) -> list[tuple[str, int]]:
    result = []
    for resource in getattr(response, "resources"):
        assignment = endpoint_pb2.ClusterLoadAssignment.FromString(resource.value)
        result += [(e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value)
                   for g in assignment.endpoints for e in g.lb_endpoints]
    return sorted(result)


async def test_mesh_networks_key_of_the_configmap(kube: client.ApiClient,
                                                  start_istiod_kube: Callable[..., Istiod]) -> None:
    await install_crds(kube)
    core = client.CoreV1Api(kube)
    await ensure_namespace(kube, ISTIO_NAMESPACE)
    await ensure_namespace(kube, NAMESPACE)
    await create_istio_object(kube, {
        "apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry", "metadata": {"name": "echo", "namespace": NAMESPACE},
        "spec": {"hosts": [HOST], "location": "MESH_INTERNAL", "resolution": "STATIC",
                 "ports": [{"number": 80, "name": "http", "protocol": "HTTP"}], "workloadSelector": {"labels": {"app": "echo"}}}})
    for name, address, network in (("local", "10.0.1.1", "n1"), ("remote", "10.0.2.1", "n2")):
        await create_istio_object(kube, {
            "apiVersion": "networking.istio.io/v1", "kind": "WorkloadEntry", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"address": address, "network": network, "serviceAccount": "echo",
                     "labels": {"app": "echo", "security.istio.io/tlsMode": "istio"}}})
    configmap = {"metadata": {"name": "istio", "namespace": ISTIO_NAMESPACE},
                 "data": {"mesh": "rootNamespace: istio-system\n", "meshNetworks": NETWORKS % "192.0.2.2"}}
    await core.create_namespaced_config_map(ISTIO_NAMESPACE, configmap)
    try:
        istiod = start_istiod_kube()
        ads = AdsClient(istiod.xds_address, f"sidecar~10.0.1.5~client.{NAMESPACE}~{NAMESPACE}.svc.cluster.local", NAMESPACE)
        ads.node.metadata.update({"NETWORK": "n1"})
        try:
            response = await ads.subscribe(types.ENDPOINT, [CLUSTER])
            assert _addresses(response) == [("10.0.1.1", 80), ("192.0.2.2", 15443)]  # n2 through its gateway
            await core.patch_namespaced_config_map("istio", ISTIO_NAMESPACE,
                                                   {"data": {"meshNetworks": NETWORKS % "192.0.2.9"}})
            pushed = await ads.receive()  # the edit re-pushes EDS, no restart
            assert _addresses(pushed) == [("10.0.1.1", 80), ("192.0.2.9", 15443)]
            ads.send(types.ENDPOINT, [CLUSTER], pushed)
            await core.patch_namespaced_config_map("istio", ISTIO_NAMESPACE, {"data": {
                "meshNetworks": "networks: {n2: {endpoints: [{fromCidr: 10.0.2.0/99}]}}"}})
            wait_until(lambda: "10.0.2.0/99 is not a valid CIDR block" in istiod.log(), 10,
                       "the bad edit refused, naming the field")
            assert istiod.get("/ready")[0] == 200
        finally:
            await ads.close()
    finally:
        await core.delete_namespaced_config_map("istio", ISTIO_NAMESPACE)


async def test_gateway_service_with_a_load_balancer_status(kube: client.ApiClient,
                                                          start_istiod_kube: Callable[..., Istiod]) -> None:
    await install_crds(kube)
    core = client.CoreV1Api(kube)
    namespace = "e2e-eastwest"
    host = f"echo.{namespace}.svc.cluster.local"
    await ensure_namespace(kube, ISTIO_NAMESPACE)
    await ensure_namespace(kube, namespace)
    await create_istio_object(kube, {
        "apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry", "metadata": {"name": "echo", "namespace": namespace},
        "spec": {"hosts": [host], "location": "MESH_INTERNAL", "resolution": "STATIC",
                 "ports": [{"number": 80, "name": "http", "protocol": "HTTP"}], "workloadSelector": {"labels": {"app": "echo"}}}})
    for name, address, network in (("local", "10.0.1.1", "n1"), ("remote", "10.0.2.1", "n2")):
        await create_istio_object(kube, {
            "apiVersion": "networking.istio.io/v1", "kind": "WorkloadEntry", "metadata": {"name": name, "namespace": namespace},
            "spec": {"address": address, "network": network, "serviceAccount": "echo",
                     "labels": {"app": "echo", "security.istio.io/tlsMode": "istio"}}})
    gateway = {"metadata": {"name": "istio-eastwestgateway", "namespace": namespace,
                            "labels": {"topology.istio.io/network": "n2"}},
               "spec": {"type": "LoadBalancer", "ports": [{"name": "tls", "port": 15443}]}}
    await core.create_namespaced_service(namespace, gateway)
    istiod = start_istiod_kube()
    ads = AdsClient(istiod.xds_address, f"sidecar~10.0.1.5~client.{namespace}~{namespace}.svc.cluster.local", namespace)
    ads.node.metadata.update({"NETWORK": "n1"})
    name = f"outbound|80||{host}"
    try:
        # No address yet: no gateway, so n2's endpoint is sent as it is.
        assert _addresses(await ads.subscribe(types.ENDPOINT, [name])) == [("10.0.1.1", 80), ("10.0.2.1", 80)]
        await core.patch_namespaced_service_status("istio-eastwestgateway", namespace, {
            "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.44"}]}}})
        pushed = await ads.receive()  # the cloud's load balancer got its IP: a push, no restart
        assert _addresses(pushed) == [("10.0.1.1", 80), ("192.0.2.44", 15443)]
        ads.send(types.ENDPOINT, [name], pushed)
        # A load balancer known by hostname only (as AWS's): istiod resolves it (RESOLVE_HOSTNAME_GATEWAYS).
        await core.patch_namespaced_service_status("istio-eastwestgateway", namespace, {
            "status": {"loadBalancer": {"ingress": [{"hostname": "localhost"}]}}})
        pushed = await ads.receive()
        while ("127.0.0.1", 15443) not in _addresses(pushed):
            ads.send(types.ENDPOINT, [name], pushed)
            pushed = await ads.receive()
        print("gateway by hostname localhost:", _addresses(pushed))
        assert ("10.0.1.1", 80) in _addresses(pushed) and ("10.0.2.1", 80) not in _addresses(pushed)
    finally:
        await ads.close()

"""Objects the API's validation would refuse, planted straight into etcd, reach istiod's informers:
each is logged with its name and skipped, and the informer keeps going."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from kubernetes_asyncio import client

from e2e.harness import Cluster
from e2e.kube_objects import ensure_namespace, service_body
from tests.peers import Istiod, wait_until

NS = "e2e-bad"


def stored(kind: str, api_version: str, name: str, **fields: object) -> str:
    metadata = {"name": name, "namespace": NS, "uid": str(uuid.uuid4()), "creationTimestamp": "2026-12-02T00:00:00Z"}
    return json.dumps({"kind": kind, "apiVersion": api_version, "metadata": metadata, **fields})


async def test_invalid_objects_are_logged_and_skipped(
    cluster: Cluster, kube: client.ApiClient, start_istiod_kube: Callable[..., Istiod]
) -> None:
    core = client.CoreV1Api(kube)
    await ensure_namespace(kube, NS)
    await core.create_namespaced_service(NS, service_body("before"))
    istiod = start_istiod_kube()
    cluster.plant(f"/registry/services/specs/{NS}/port-too-big",
                  stored("Service", "v1", "port-too-big", spec={"ports": [{"port": 70000, "protocol": "TCP"}]}))
    cluster.plant(f"/registry/services/specs/{NS}/twice",
                  stored("Service", "v1", "twice", spec={"ports": [{"port": 80}, {"port": 80, "name": "b"}]}))
    cluster.plant(f"/registry/endpointslices/{NS}/bad-slice",
                  stored("EndpointSlice", "discovery.k8s.io/v1", "bad-slice", addressType="IPv4",
                         ports=[{"name": "grpc", "port": 0}], endpoints=[{"addresses": ["192.0.2.9"]}]))
    await core.create_namespaced_service(NS, service_body("after"))

    expected = [
        f"kube Service {NS}/port-too-big: spec.ports[0].port 70000 is not in 1-65535; skipped",
        f"kube Service {NS}/twice: spec.ports has the same port twice; skipped",
        f"kube EndpointSlice {NS}/bad-slice: ports[0].port 0 is not in 1-65535; skipped",
    ]
    wait_until(lambda: all(line in istiod.text() for line in expected), 10, f"log lines {expected}")

    def hosts() -> list[str]:
        return sorted(s["hostname"] for s in istiod.get("/debug/registryz")[1] if s["Attributes"]["Namespace"] == NS)

    wait_until(lambda: hosts() == [f"after.{NS}.svc.cluster.local", f"before.{NS}.svc.cluster.local"], 5,
               "the valid services, and only them")
    assert istiod.proc.poll() is None

"""Creating what the controllers would (pods with status, EndpointSlices) through the real API."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.leader import LeaderElection, LeaseTimings

ISTIO_NAMESPACE = "istio-system"  # istiod's (POD_NAMESPACE's default): its CA Secret and leader-election ConfigMap live here


async def ensure_namespace(api: client.ApiClient, name: str, labels: dict[str, str] | None = None) -> None:
    core = client.CoreV1Api(api)
    try:
        await core.create_namespace({"metadata": {"name": name, "labels": labels or {}}})
    except ApiException as error:
        if error.status != 409:
            raise
    try:
        await core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})
    except ApiException as error:
        if error.status != 409:
            raise


def pod_body(name: str, app: str, port: int, owner: dict[str, Any] | None = None,
             claim: str = "", labels: dict[str, str] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": {"app": app, **(labels or {})}}
    if owner:
        metadata["ownerReferences"] = [owner]
    spec: dict[str, Any] = {
        "serviceAccountName": "default",
        "containers": [{"name": "app", "image": "demo/echo", "ports": [{"name": "grpc", "containerPort": port}]}],
    }
    if claim:
        spec["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
    return {"metadata": metadata, "spec": spec}


async def create_running_pod(api: client.ApiClient, namespace: str, body: dict[str, Any], ip: str) -> None:
    """A pod as the kubelet would report it: Running, Ready, with its IP."""
    core = client.CoreV1Api(api)
    await core.create_namespaced_pod(namespace, body)
    status = {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                         "conditions": [{"type": "Ready", "status": "True"}]}}
    await core.patch_namespaced_pod_status(body["metadata"]["name"], namespace, status)


def slice_body(name: str, service: str, port: int, endpoints: list[tuple[str, str]]) -> dict[str, Any]:
    """An EndpointSlice as the endpointslice controller would write it: (ip, pod name) pairs."""
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": True}, "targetRef": {"kind": "Pod", "name": pod}}
            for ip, pod in endpoints
        ],
    }


def service_body(name: str, port: int = 7070) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "spec": {"selector": {"app": name}, "ports": [{"name": "grpc", "port": port, "targetPort": "grpc"}]}}


async def echo_service(api: client.ApiClient, start_demo: Callable[..., Any], namespace: str, name: str,
                       ips: dict[str, str]) -> int:
    """Service `name` (port 7070) with a live echo backend per (pod, ip) and the first pod created;
    returns the backends' port, one number free on every ip (pods share a targetPort)."""
    port = port_free_on(*ips.values())
    for pod, ip in ips.items():
        start_demo("server", "--address", f"{ip}:{port}", "--name", pod, name=pod).next_json(15)
    await client.CoreV1Api(api).create_namespaced_service(namespace, service_body(name))
    first_pod, first_ip = next(iter(ips.items()))
    await create_running_pod(api, namespace, pod_body(first_pod, name, port), first_ip)
    return port


def port_free_on(*ips: str) -> int:
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((ips[0], 0))
            port = probe.getsockname()[1]
        try:
            for ip in ips[1:]:
                with socket.socket() as other:
                    other.bind((ip, port))
            return port
        except OSError:
            continue
    raise AssertionError(f"no port free on all of {ips}")


@contextlib.asynccontextmanager
async def another_replica_leading(api: client.ApiClient, election: str) -> AsyncIterator[None]:
    """Another replica holds the lock `election` (on a short lease) until the block ends, then hands it back."""
    other = LeaderElection(api, ISTIO_NAMESPACE, election, "other-replica",
                           LeaseTimings(duration=2.0, renew_deadline=1.5, retry_period=0.25))
    held = asyncio.Event()

    async def hold() -> None:
        held.set()
        await asyncio.Future()

    holder = asyncio.create_task(other.run(hold))
    try:
        await asyncio.wait_for(held.wait(), 10)
        yield
    finally:
        holder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holder

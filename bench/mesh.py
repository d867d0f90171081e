"""The load benchmark's mesh and its changes, written where istiod reads them: files in a config
dir, or objects in a real kube-apiserver (the e2e harness's etcd + kube-apiserver).

Service `s` is svc<s> in namespace ns<s % 10> with port 7070 and `pods` endpoints; s < 0 is the
Service every client watches. A change gives pod 0 a marked address (loadgen.mark_address), which
the clients find again in what they hold. Each change's write time is kept: the start of the file
write, or of the API request.

Through the API a Service has its Pods (created, then their status written as the kubelet
would) and, outside an ambient mesh, the EndpointSlice the endpointslice controller would write
for them: a change gives pod 0 the marked IP in its status and then in the slice, as a cluster
sees a pod restart, timed from the slice's write.

An ambient mesh (`nodes` > 0) looks like a cluster's for ztunnel: its namespaces are labelled
`istio.io/dataplane-mode=ambient`, its pods carry istio-cni's `ambient.istio.io/redirection: enabled`
and are spread over `nodes` Nodes; its changes are pods' IPs only (no EndpointSlices).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import loadgen
from e2e.kube_objects import ensure_namespace, service_body, slice_body
from istiod.kubeapi import api_client
import yaml
from kubernetes_asyncio import client

DOMAIN = "svc.cluster.local"
EVERYONE = "everyone"  # the Service every client watches, created by the last scenario
NAMESPACES = 10
PORT = 7070
# Creates in flight at once when the mesh is made through the API: enough to keep the API server
# busy without queueing thousands of requests in its priority-and-fairness seats.
CONCURRENT_CREATES = 32


def service_name(s: int) -> tuple[str, str]:
    """(name, namespace) of service `s`."""
    return (EVERYONE, "ns0") if s < 0 else (f"svc{s}", f"ns{s % NAMESPACES}")


def listener(s: int) -> str:
    name, namespace = service_name(s)
    return f"{name}.{namespace}.{DOMAIN}:{PORT}"


def pod_ips(s: int, pods: int, mark: int | None) -> list[str]:
    """The pods' addresses; pod 0's is the marked one of change `mark` if set."""
    return [loadgen.mark_address(mark) if p == 0 and mark is not None else f"10.{s // 250 % 250}.{s % 250}.{p + 1}"
            for p in range(pods)]


AMBIENT_NAMESPACE = {"istio.io/dataplane-mode": "ambient"}
REDIRECTED = {"ambient.istio.io/redirection": "enabled"}  # what istio-cni writes on a pod it captured


def node_name(n: int) -> str:
    return f"node-{n}"


def pod_node(s: int, p: int, pods: int, nodes: int) -> str:
    """The node of service `s`'s pod `p`: the mesh's pods dealt round the nodes."""
    return node_name((max(s, 0) * pods + p) % nodes)


def pod_body(s: int, p: int, pods: int, nodes: int) -> dict[str, Any]:
    name, _ = service_name(s)
    spec: dict[str, Any] = {"containers": [{"name": "app", "image": "bench", "ports": [{"containerPort": PORT}]}]}
    metadata: dict[str, Any] = {"name": f"{name}-{p}", "labels": {"app": name}}
    if nodes:
        spec["nodeName"] = pod_node(s, p, pods, nodes)
        metadata["annotations"] = REDIRECTED
    return {"metadata": metadata, "spec": spec}


def pod_status(ip: str) -> dict[str, Any]:
    return {"podIP": ip, "podIPs": [{"ip": ip}], "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}


def service_yaml(s: int, pods: int, mark: int | None, nodes: int = 0) -> str:
    """Service `s` and its pods as a config-dir file (the config dir has no EndpointSlices: the
    endpoints come from the pods the selector picks)."""
    name, ns = service_name(s)
    docs: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
                                   "spec": {"selector": {"app": name}, "ports": [{"name": "grpc", "port": PORT}]}}]
    for p, ip in enumerate(pod_ips(s, pods, mark)):
        pod = pod_body(s, p, pods, nodes)
        pod["metadata"]["namespace"] = ns
        docs.append({"apiVersion": "v1", "kind": "Pod", **pod, "status": pod_status(ip)})
    return yaml.safe_dump_all(docs)


def ambient_yaml(nodes: int) -> str:
    """The ambient mesh's Namespaces and Nodes, as a config-dir file."""
    docs: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Namespace",
                                   "metadata": {"name": f"ns{n}", "labels": AMBIENT_NAMESPACE}} for n in range(NAMESPACES)]
    docs += [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": node_name(n)}} for n in range(nodes)]
    return yaml.safe_dump_all(docs)


class ConfigDirMesh:
    """One file per Service (the Service and its pods), replaced at once on each change."""

    def __init__(self, root: Path, pods: int, nodes: int = 0) -> None:
        self.root, self.pods, self.nodes = root, pods, nodes
        self.written: dict[int, float] = {}  # mark -> when its write started

    def source_args(self) -> list[str]:
        return ["--config-dir", str(self.root)]

    def create(self, services: int) -> None:
        if self.nodes:
            (self.root / "ambient.yaml").write_text(ambient_yaml(self.nodes))
        for s in range(services):
            self._write(s, self.pods, None)

    def change(self, s: int, mark: int) -> None:
        self.written[mark] = time.time()
        self._write(s, self.pods, mark)

    def add(self, s: int, pods: int, mark: int) -> None:
        self.written[mark] = time.time()
        self._write(s, pods, mark)

    def settle(self) -> dict[int, float]:
        """Every change's write time, once all are done."""
        return self.written

    def close(self) -> None:
        pass

    def _write(self, s: int, pods: int, mark: int | None) -> None:
        """Replace the file at once (a rename), so the watcher never reads half of it."""
        path = self.root / f"{service_name(s)[0]}.yaml"
        tmp = self.root.parent / f".{path.name}.tmp"
        tmp.write_text(service_yaml(s, pods, mark, self.nodes))
        os.replace(tmp, path)


class KubeMesh:
    """Services, their Pods and (outside an ambient mesh) one EndpointSlice each, through the API as
    the admin user; an asyncio loop in
    a thread of its own sends the writes, so a slow API server delays the changes' delivery, not
    the churn's pace."""

    def __init__(self, kubeconfig: Path, pods: int, nodes: int = 0) -> None:
        self.kubeconfig, self.pods, self.nodes = kubeconfig, pods, nodes
        self.written: dict[int, float] = {}
        self.pending: list[Future[None]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kube-writes", daemon=True)
        self.thread.start()
        self.api: client.ApiClient = self.run(api_client(kubeconfig), 30)
        # One change of a Service at a time, so writes of the same slice land in the churn's order.
        self.locks: dict[int, asyncio.Lock] = defaultdict(asyncio.Lock)

    def source_args(self) -> list[str]:
        return ["--kubeconfig", str(self.kubeconfig)]

    def run(self, coroutine: Any, timeout: float) -> Any:
        """`coroutine` on the mesh's loop (its API client's), waited for."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def create(self, services: int) -> None:
        """Every Service and its slice, CONCURRENT_CREATES requests in flight."""
        self.run(self._create_all(services), 600)

    async def _create_all(self, services: int) -> None:
        labels = AMBIENT_NAMESPACE if self.nodes else None
        await asyncio.gather(*(ensure_namespace(self.api, service_name(n)[1], labels) for n in range(NAMESPACES)),
                             ensure_namespace(self.api, "bench"))  # the clients' namespace
        for n in range(self.nodes):
            await _write(client.CoreV1Api(self.api).create_node, {"metadata": {"name": node_name(n)}})
        seats = asyncio.Semaphore(CONCURRENT_CREATES)

        async def create(s: int) -> None:
            async with seats:
                await self._create(s, self.pods, None)

        await asyncio.gather(*(create(s) for s in range(services)))

    async def _create(self, s: int, pods: int, mark: int | None) -> None:
        name, namespace = service_name(s)
        if mark is not None:
            self.written[mark] = time.time()
        await _write(client.CoreV1Api(self.api).create_namespaced_service, namespace, service_body(name, PORT))
        core = client.CoreV1Api(self.api)
        for p, ip in enumerate(pod_ips(s, pods, mark)):  # a Pod is created without status: the kubelet writes it
            await _write(core.create_namespaced_pod, namespace, pod_body(s, p, pods, self.nodes))
            await self._pod_ip(s, p, ip)
        if not self.nodes:
            await _write(client.DiscoveryV1Api(self.api).create_namespaced_endpoint_slice, namespace,
                         self._slice(s, pods, mark))

    async def _pod_ip(self, s: int, p: int, ip: str) -> None:
        name, namespace = service_name(s)
        await _write(client.CoreV1Api(self.api).patch_namespaced_pod_status, f"{name}-{p}", namespace,
                     {"status": pod_status(ip)}, _content_type="application/merge-patch+json")

    def _slice(self, s: int, pods: int, mark: int | None) -> dict[str, Any]:
        name, _ = service_name(s)
        return slice_body(f"{name}-0", name, PORT, [(ip, f"{name}-{p}") for p, ip in enumerate(pod_ips(s, pods, mark))])

    def change(self, s: int, mark: int) -> None:
        self.pending.append(asyncio.run_coroutine_threadsafe(self._change(s, mark), self.loop))

    async def _change(self, s: int, mark: int) -> None:
        name, namespace = service_name(s)
        body = self._slice(s, self.pods, mark)
        async with self.locks[s]:
            if self.nodes:
                self.written[mark] = time.time()
                await self._pod_ip(s, 0, loadgen.mark_address(mark))
                return
            # The kubelet's write, then the endpointslice controller's: istiod's endpoints (and the
            # change's time) are the slice's.
            await self._pod_ip(s, 0, loadgen.mark_address(mark))
            self.written[mark] = time.time()
            # A merge patch replaces the whole endpoints list, as the controller's update does.
            await _write(client.DiscoveryV1Api(self.api).patch_namespaced_endpoint_slice,
                         body["metadata"]["name"], namespace, {"endpoints": body["endpoints"]},
                         _content_type="application/merge-patch+json")

    def add(self, s: int, pods: int, mark: int) -> None:
        self.pending.append(asyncio.run_coroutine_threadsafe(self._create(s, pods, mark), self.loop))

    def settle(self) -> dict[int, float]:
        for write in self.pending:
            write.result(60)  # a failed write fails the run: its change would count as never seen
        self.pending.clear()
        return self.written

    def close(self) -> None:
        try:
            self.run(self.api.close(), 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


async def _write(call: Any, *args: Any, **kwargs: Any) -> None:
    """An API write whose reply is checked, not decoded into the client's models: decoding costs
    the benchmark's process more CPU than sending the request."""
    reply = await call(*args, _preload_content=False, **kwargs)
    try:
        if not 200 <= reply.status < 300:
            raise RuntimeError(f"{reply.method} {reply.url}: {reply.status} {await reply.text()}")
    finally:
        reply.release()

"""Faults under a running istiod: API server and etcd restarts, changes during an outage, 410 Gone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from kubernetes_asyncio import client

from e2e.harness import ApiServer, Cluster
from e2e.kube_objects import create_running_pod, echo_service, ensure_namespace, pod_body, service_body
from istiod.backoff import Backoff
from istiod.kubeapi import api_client
from istiod.sources.convert import ObjectKey
from istiod.sources.kube import Informer, KubeWriter, list_calls
from istiod.sources.namespaces import NamespaceFilter
from istiod.sources.store import Store
from tests.peers import Istiod, Process, eventually, free_port, wait_until
from tests.pki import write_plugged
from tests.test_proxyless_grpc import replies_from, start_client, wait_for_replies

NS = "e2e-faults"
# Reconnects back off with jitter up to 30 s, so a restart may take that long to be noticed.
RECONNECT = 45.0


def endpoint_addresses(istiod: Istiod, host: str) -> list[str]:
    status, view = istiod.get("/debug/endpointz")
    return [e["address"] for e in view.get(host, {}).get("7070", [])] if status == 200 else []


async def test_restarts_keep_serving_and_catch_up(
    cluster: Cluster, kube: client.ApiClient, start_istiod_kube: Callable[..., Istiod], start_demo: Callable[..., Process]
) -> None:
    core = client.CoreV1Api(kube)
    await ensure_namespace(kube, NS)
    ips = {"faulty-a": "127.0.0.51", "faulty-b": "127.0.0.52"}
    port = await echo_service(kube, start_demo, NS, "faulty", ips)
    istiod = start_istiod_kube()
    host = f"faulty.{NS}.svc.cluster.local"
    client_proc = start_client(start_demo, istiod, f"xds:///{host}:7070", NS)
    wait_until(lambda: any(l["ok"] for l in client_proc.drain()), 20, "a first reply")

    # The API server goes away; a second one (same etcd) takes a change meanwhile.
    second = cluster.second_apiserver()
    try:
        cluster.apiserver.stop()
        async with await api_client(second.kubeconfig) as other:
            await create_running_pod(other, NS, pod_body("faulty-b", "faulty", port), ips["faulty-b"])
        assert replies_from(client_proc, 1.0) == {"faulty-a"}  # last good state keeps serving
        cluster.apiserver.start()
        took = wait_for_replies(client_proc, {"faulty-a", "faulty-b"}, timeout=RECONNECT)
        print(f"change made during the API server outage seen {took:.1f}s after its restart")
    finally:
        second.stop()
    assert endpoint_addresses(istiod, host) == [ips["faulty-a"], ips["faulty-b"]]  # nothing lost or doubled
    assert "relisting" in istiod.text()

    cluster.etcd.stop()
    try:
        assert replies_from(client_proc, 2.0) == {"faulty-a", "faulty-b"}
    finally:
        cluster.start_etcd()
    wait_until(cluster.apiserver.ready, 60, "the API server to see etcd again")
    await core.delete_namespaced_pod("faulty-a", NS, grace_period_seconds=0)
    took = wait_for_replies(client_proc, {"faulty-b"}, timeout=RECONNECT)
    print(f"change after the etcd restart seen in {took:.1f}s")
    assert endpoint_addresses(istiod, host) == [ips["faulty-b"]]
    await core.delete_namespaced_service("faulty", NS)


async def test_watch_from_a_compacted_revision_relists(cluster: Cluster, kube: client.ApiClient) -> None:
    """Compact etcd past the informer's resourceVersion: the API answers 410 and it relists."""
    core = client.CoreV1Api(kube)
    await ensure_namespace(kube, NS)
    store = Store()
    informer = Informer("Service", list_calls(kube)["Service"], KubeWriter(store, NamespaceFilter()),
                        watch_timeout=1, backoff=Backoff(initial=0.1, cap=0.5))
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 20)
        stale = informer.resource_version
        await core.create_namespaced_service(NS, service_body("compacted"))
        compacted = ObjectKey("Service", NS, "compacted")
        await eventually(lambda: compacted in store.keys("Service"), 10, "the Service in the store")
        await core.delete_namespaced_service("compacted", NS)
        await eventually(lambda: compacted not in store.keys("Service"), 10, "the Service gone from the store")
        revision = cluster.compact()
        assert int(stale) < revision  # type: ignore[arg-type]
        relists = informer.relists
        informer.resource_version = stale  # the next watch resumes from before the compaction
        await eventually(lambda: informer.gone == 1 and informer.relists > relists, 10, "a 410 and a relist")
        assert int(informer.resource_version) >= revision  # type: ignore[arg-type]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_not_ready_until_the_api_answers(cluster: Cluster, tmp_path: Path, processes: list[Process]) -> None:
    """With the API unreachable istiod serves /ready as 503, backs off, and becomes ready once it is.
    (A plugged-in CA, because a self-signed one waits for its Secret before any port opens.)"""
    unreachable = tmp_path / "unreachable.kubeconfig"
    dead_port = free_port()
    unreachable.write_text(cluster.kubeconfig.read_text().replace(cluster.apiserver.url, f"https://127.0.0.1:{dead_port}"))
    write_plugged(tmp_path / "cacerts")
    istiod = Istiod(tmp_path, "--kubeconfig", str(unreachable), "--plugged-ca-dir", str(tmp_path / "cacerts"),
                    ready_timeout=None)
    processes.append(istiod)
    wait_until(lambda: istiod.text().count("relisting in") >= 6, 20, "a few backed-off retries")
    assert istiod.get("/ready")[0] == 503
    delays = [float(line.split("relisting in ")[1].split("s")[0]) for line in istiod.text().splitlines() if "relisting in" in line]
    assert len(set(delays)) > 1  # jittered, not a fixed period

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e.harness import Cluster
from e2e.kube_objects import ISTIO_NAMESPACE, ensure_namespace
from istiod.kubeapi import api_client
from tests.conftest import processes, start_agent, start_demo  # noqa: F401  (shared fixtures)
from tests.peers import Istiod, Process


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One etcd + kube-apiserver for the whole e2e session."""
    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def kube(cluster: Cluster) -> AsyncIterator[client.ApiClient]:
    async with await api_client(cluster.kubeconfig) as api:
        yield api


@pytest.fixture
async def start_istiod_kube(
    cluster: Cluster, kube: client.ApiClient, tmp_path: Path, processes: list[Process]  # noqa: F811
) -> Callable[..., Istiod]:
    await ensure_namespace(kube, ISTIO_NAMESPACE)  # where istiod's CA keeps its root Secret

    def start(*extra: str) -> Istiod:
        istiod = Istiod(tmp_path, "--kubeconfig", str(cluster.kubeconfig), *extra, ready_timeout=60)
        processes.append(istiod)
        return istiod

    return start

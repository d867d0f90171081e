"""Revisions, ours beside Istio's own istiod (pilot-discovery, built by shared/reference-istiod/build.sh)
on the e2e kube-apiserver: both read the same VirtualServices (unlabelled, labelled istio.io/rev=py,
labelled istio.io/rev=default) and contend for the same leader lock (istio-namespace-controller-election).
Run twice, each control plane once the default revision (named by istio-revision-tag-default) and once
`py`: the py one leads first, then the default one must take the lock from it (istiod's prioritized
election), and each must read only its revision's config. Prints what each did; exit 1 on a difference.

    .venv/bin/python bench/revision_compare.py [--reference PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))
from e2e.harness import Cluster  # noqa: E402
from e2e.istio_crds import create_istio_object, install_crds  # noqa: E402
from e2e.kube_objects import ensure_namespace  # noqa: E402
from istiod.kubeapi import api_client  # noqa: E402
from reference import add_reference_argument, reference_binary, start_reference  # noqa: E402
from tests.peers import Istiod, free_port, stop_group  # noqa: E402

LOCK, RECORD = "istio-namespace-controller-election", "control-plane.alpha.kubernetes.io/leader"
ROUTES = {"shared": {}, "for-py": {"istio.io/rev": "py"}, "for-default": {"istio.io/rev": "default"}}
EXPECTED = {"default": ["for-default", "shared"], "py": ["for-py", "shared"]}


async def prepare(kubeconfig: Path) -> None:
    async with await api_client(kubeconfig) as kube:
        await ensure_namespace(kube, "istio-system")
        await install_crds(kube)
        for name, labels in ROUTES.items():
            await create_istio_object(kube, {
                "apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
                "metadata": {"name": name, "namespace": "default", "labels": labels},
                "spec": {"hosts": ["echo"], "http": [{"route": [{"destination": {"host": "echo"}}]}]}})
        await client.AdmissionregistrationV1Api(kube).create_mutating_webhook_configuration({
            "metadata": {"name": "istio-revision-tag-default", "labels": {"istio.io/rev": "default", "istio.io/tag": "default"}},
            "webhooks": []})


async def holder_key(kubeconfig: Path) -> str:
    async with await api_client(kubeconfig) as kube:
        with contextlib.suppress(client.ApiException):
            lock = await client.CoreV1Api(kube).read_namespaced_config_map(LOCK, "istio-system")
            return str(json.loads((lock.metadata.annotations or {}).get(RECORD, "{}")).get("holderKey", ""))
    return ""


async def wait_for_key(kubeconfig: Path, key: str, timeout: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if await holder_key(kubeconfig) == key:
            return time.monotonic() - start
        await asyncio.sleep(0.25)
    return None


def virtual_services(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/debug/configz", timeout=5) as reply:
        objects: list[dict[str, Any]] = json.loads(reply.read()) or []
    return sorted(o["metadata"]["name"] for o in objects if o.get("kind") == "VirtualService")


def run(binary: str, istio_revision: str) -> int:
    ours_revision = "py" if istio_revision == "default" else "default"
    print(f"--- Istio's istiod is revision {istio_revision}, ours is {ours_revision}")
    with tempfile.TemporaryDirectory(prefix="revision-compare-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        (workdir / "cluster").mkdir()
        (workdir / "ours").mkdir()
        cluster = Cluster(workdir / "cluster")
        stack.callback(cluster.stop)
        cluster.start()
        asyncio.run(prepare(cluster.kubeconfig))
        ours_args = ["--kubeconfig", str(cluster.kubeconfig), "--revision", ours_revision, "--leader-lease-duration",
                     "6s", "--leader-renew-deadline", "4s", "--leader-retry-period", "1s"]
        istio_http = free_port()

        def start_istio() -> None:
            process, _, _ = start_reference(binary, cluster.kubeconfig, workdir, istio_revision, istio_http)
            stack.callback(stop_group, process, 10)

        def start_ours() -> Istiod:
            ours = Istiod(workdir / "ours", *ours_args, ready_timeout=60)
            stack.callback(ours.stop)
            return ours

        # The py one first, so that the default one has a lock to take.
        if istio_revision == "py":
            start_istio()
            first = asyncio.run(wait_for_key(cluster.kubeconfig, "py", 30))
            ours = start_ours()
        else:
            ours = start_ours()
            first = asyncio.run(wait_for_key(cluster.kubeconfig, "py", 30))
            start_istio()
        took = asyncio.run(wait_for_key(cluster.kubeconfig, "default", 60))
        time.sleep(3)
        kept = asyncio.run(holder_key(cluster.kubeconfig))
        seen = {istio_revision: virtual_services(f"http://127.0.0.1:{istio_http}"),
                ours_revision: virtual_services(ours.url())}
        print(f"py led (holderKey py) {'yes' if first is not None else 'NO'}; the default revision took the lock "
              f"{'within %.1fs of starting to watch' % took if took is not None else 'NOT AT ALL'}; 3s later holderKey is "
              f"{kept!r}")
        for revision, names in seen.items():
            who = "Istio's" if revision == istio_revision else "ours"
            print(f"{who} ({revision}) reads VirtualServices {names}")
        return int(first is None or took is None or kept != "default" or seen != EXPECTED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_reference_argument(parser)
    args = parser.parse_args()
    binary = reference_binary(parser, args)
    sys.exit(max(run(binary, "default"), run(binary, "py")))


if __name__ == "__main__":
    main()

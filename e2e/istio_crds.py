"""Installing crds/ into the test cluster and creating Istio objects, as `kubectl apply` would."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.model.config.kinds import BY_KIND
from tests.peers import ROOT


async def install_crds(api: client.ApiClient) -> None:
    """Every CRD in crds/, once per cluster, and wait until the API serves them."""
    await install_crd_files(api, sorted((ROOT / "crds").glob("*.yaml")), "Istio's CRDs")


def module_dir(module: str, version: str) -> Path:
    """A Go module's files, downloaded into the module cache with `go mod download` when not there."""
    done = subprocess.run(["go", "mod", "download", "-json", f"{module}@{version}"], capture_output=True, text=True,
                          timeout=300, cwd="/")
    if done.returncode != 0:
        raise RuntimeError(f"go mod download {module}@{version}: {done.stdout[-500:]} {done.stderr[-500:]}")
    return Path(json.loads(done.stdout)["Dir"])


async def install_upstream_crds(api: client.ApiClient, kinds: Iterable[str]) -> None:
    """Istio's own CRDs of `kinds` (those this istiod does not ship), from the istio.io/istio module at the
    version e2e/cluster/istio/go.mod pins: the CRDs a cluster moving from Istio's istiod has."""
    pinned = re.search(r"^\s*istio\.io/istio (\S+)", (ROOT / "e2e" / "cluster" / "istio" / "go.mod").read_text(), re.M)
    assert pinned, "e2e/cluster/istio/go.mod pins no istio.io/istio"
    path = module_dir("istio.io/istio", pinned.group(1)) / "manifests" / "charts" / "base" / "files" / "crd-all.gen.yaml"
    wanted = set(kinds)
    bodies = [b for b in yaml.safe_load_all(path.read_text())
              if b and b.get("kind") == "CustomResourceDefinition" and b["spec"]["names"]["kind"] in wanted]
    await install_crd_bodies(api, bodies, f"Istio's CRDs of {', '.join(sorted(wanted))}")


async def install_crd_files(api: client.ApiClient, paths: Iterable[Path], what: str) -> None:
    """Every CustomResourceDefinition in the files (other kinds skipped), and wait until the API
    serves them."""
    await install_crd_bodies(api, [body for path in paths for body in yaml.safe_load_all(path.read_text())
                                   if body and body.get("kind") == "CustomResourceDefinition"], what)


async def install_crd_bodies(api: client.ApiClient, bodies: list[dict[str, Any]], what: str) -> None:
    extensions = client.ApiextensionsV1Api(api)
    names = []
    for body in bodies:
        names.append(body["metadata"]["name"])
        try:
            await extensions.create_custom_resource_definition(body)
        except ApiException as error:
            if error.status != 409:
                raise
    for _ in range(200):
        crds = [await extensions.read_custom_resource_definition(name) for name in names]
        if all(any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or []) for crd in crds):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} were not established within 10s")


async def create_istio_object(api: client.ApiClient, body: dict[str, Any]) -> None:
    group, _, version = body["apiVersion"].partition("/")
    kind = BY_KIND[body["kind"]]
    await client.CustomObjectsApi(api).create_namespaced_custom_object(
        group, version, body["metadata"]["namespace"], kind.plural, body)

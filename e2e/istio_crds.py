"""Installing crds/ into the test cluster and creating Istio objects, as `kubectl apply` would."""

from __future__ import annotations

import asyncio
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


async def install_crd_files(api: client.ApiClient, paths: Iterable[Path], what: str) -> None:
    """Every CustomResourceDefinition in the files (other kinds skipped), and wait until the API
    serves them."""
    extensions = client.ApiextensionsV1Api(api)
    names = []
    for path in paths:
        for body in yaml.safe_load_all(path.read_text()):
            if not body or body.get("kind") != "CustomResourceDefinition":
                continue
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

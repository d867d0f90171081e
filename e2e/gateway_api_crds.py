"""The Gateway API's CRDs as the `sigs.k8s.io/gateway-api` Go module publishes them (the version
Istio pins), found in the Go module cache and downloaded there when missing; never copied here."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

MODULE = "sigs.k8s.io/gateway-api"
VERSION = "v1.6.0"


def crd_dir(channel: str = "standard") -> Path:
    """`config/crd/<channel>` of the module, downloaded with `go mod download` when not cached."""
    done = subprocess.run(["go", "mod", "download", "-json", f"{MODULE}@{VERSION}"], capture_output=True, text=True,
                          timeout=300, cwd="/")
    if done.returncode != 0:
        raise RuntimeError(f"go mod download {MODULE}@{VERSION}: {done.stdout[-500:]} {done.stderr[-500:]}")
    return Path(json.loads(done.stdout)["Dir"]) / "config" / "crd" / channel


async def install_gateway_api_crds(api: client.ApiClient, channel: str = "standard") -> None:
    """Every CustomResourceDefinition of the channel, and wait until the API serves them."""
    extensions = client.ApiextensionsV1Api(api)
    names = []
    for path in sorted(crd_dir(channel).glob("*.yaml")):
        for body in yaml.safe_load_all(path.read_text()):
            if not body or body.get("kind") != "CustomResourceDefinition":
                continue  # the channel also holds a ValidatingAdmissionPolicy
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
    raise AssertionError("the Gateway API's CRDs were not established within 10s")

"""The Gateway API's CRDs as the `sigs.k8s.io/gateway-api` Go module publishes them (the version
Istio pins), found in the Go module cache and downloaded there when missing; never copied here."""

from __future__ import annotations

from pathlib import Path

from kubernetes_asyncio import client

from e2e.istio_crds import install_crd_files, module_dir

MODULE = "sigs.k8s.io/gateway-api"
VERSION = "v1.6.0"


def crd_dir(channel: str = "standard") -> Path:
    """`config/crd/<channel>` of the module."""
    return module_dir(MODULE, VERSION) / "config" / "crd" / channel


async def install_gateway_api_crds(api: client.ApiClient, channel: str = "standard") -> None:
    """Every CustomResourceDefinition of the channel (it also holds a ValidatingAdmissionPolicy), and
    wait until the API serves them."""
    await install_crd_files(api, sorted(crd_dir(channel).glob("*.yaml")), "the Gateway API's CRDs")

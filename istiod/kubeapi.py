"""Kubernetes API clients: from a kubeconfig, or in a pod from its in-cluster config."""

from __future__ import annotations

import logging
from pathlib import Path

from kubernetes_asyncio import client, config

# The client logs every response body at debug level, Secrets' keys and TokenReviews' tokens among
# them: capped wherever our clients are made, so `--log-level debug` cannot leak them.
logging.getLogger("kubernetes_asyncio.client.rest").setLevel(logging.INFO)


async def api_client(kubeconfig: Path | None) -> client.ApiClient:
    """A client for the cluster a kubeconfig names; None means the pod's own cluster."""
    configuration = client.Configuration()
    if kubeconfig is None:
        config.load_incluster_config(client_configuration=configuration)
    else:
        await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return client.ApiClient(configuration)

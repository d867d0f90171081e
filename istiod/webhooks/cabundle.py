"""Keeps the caBundle of istiod's Validating and Mutating webhook configurations equal to its CA's
roots, as istiod's webhook controllers do, so the API server trusts the webhook's certificate."""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Literal

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.backoff import Backoff
from istiod.ca.root import CertificateAuthority
from istiod.sources.kube import API_ERRORS, describe_error

log = logging.getLogger(__name__)


def validator_name(namespace: str) -> str:
    """istiod's name for its validating webhook configuration."""
    return f"istio-validator-{namespace}"


INJECTOR = "istio-sidecar-injector"  # istiod's name for its mutating webhook configuration (default revision)


class CaBundlePatcher:
    def __init__(self, api: client.ApiClient, ca: CertificateAuthority, kind: Literal["validating", "mutating"],
                 name: str, interval: float = 30.0) -> None:
        admission = client.AdmissionregistrationV1Api(api)
        self._read = getattr(admission, f"read_{kind}_webhook_configuration")
        self._patch = getattr(admission, f"patch_{kind}_webhook_configuration")
        self.kind = f"{kind.capitalize()}WebhookConfiguration"
        self.ca = ca
        self.name = name
        self.interval = interval
        self.backoff = Backoff()

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                await self.reconcile()
                failures = 0
                delay = self.interval
            except API_ERRORS as error:
                if isinstance(error, ApiException) and error.status == 404:
                    log.debug("%s %s not found; checking again later", self.kind, self.name)
                    delay = self.interval
                else:
                    delay = self.backoff.delay(failures)
                    failures += 1
                    log.warning("webhook caBundle of %s: %s; retrying in %.1fs", self.name, describe_error(error), delay)
            await asyncio.sleep(delay)

    async def reconcile(self) -> None:
        bundle = base64.b64encode(self.ca.bundle.roots_pem.encode()).decode()
        config = await self._read(self.name)
        stale = [i for i, hook in enumerate(config.webhooks or []) if hook.client_config.ca_bundle != bundle]
        if not stale:
            return
        patch = [{"op": "replace", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle} for i in stale]
        await self._patch(self.name, patch)
        log.info("webhook caBundle of %s set to the CA's roots (%d webhooks)", self.name, len(stale))

"""Keeps the caBundle of istiod's Validating and Mutating webhook configurations equal to its CA's
roots, as istiod's webhook controllers do, so the API server trusts the webhook's certificate.

Only the configurations of istiod's own revision are touched (labelled `istio.io/rev=<revision>`:
the revision's injector and validator, and the revision tags pointing at it), and of a mutating one
only the webhooks named `*sidecar-injector.istio.io`, as Istio's patcher: two revisions side by side
never rewrite each other's webhooks."""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any, Literal

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from istiod.backoff import Backoff
from istiod.ca.root import CertificateAuthority
from istiod.revision import INJECTOR_WEBHOOK_SUFFIX, REV_LABEL, canonical
from istiod.sources.kube import API_ERRORS, describe_error

log = logging.getLogger(__name__)


class CaBundlePatcher:
    def __init__(self, api: client.ApiClient, ca: CertificateAuthority, kind: Literal["validating", "mutating"],
                 revision: str, interval: float = 30.0) -> None:
        admission = client.AdmissionregistrationV1Api(api)
        self._list = getattr(admission, f"list_{kind}_webhook_configuration")
        self._patch = getattr(admission, f"patch_{kind}_webhook_configuration")
        self.kind = f"{kind.capitalize()}WebhookConfiguration"
        self.mutating = kind == "mutating"
        self.ca = ca
        self.revision = canonical(revision)
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
                delay = self.backoff.delay(failures)
                failures += 1
                log.warning("webhook caBundle of %ss of revision %s: %s; retrying in %.1fs", self.kind, self.revision,
                            describe_error(error), delay)
            await asyncio.sleep(delay)

    def _ours(self, hook: Any) -> bool:
        return not self.mutating or str(hook.name).endswith(INJECTOR_WEBHOOK_SUFFIX)

    async def reconcile(self) -> None:
        bundle = base64.b64encode(self.ca.bundle.roots_pem.encode()).decode()
        configs = await self._list(label_selector=f"{REV_LABEL}={self.revision}")
        for config in configs.items:
            name = config.metadata.name
            stale = [i for i, hook in enumerate(config.webhooks or [])
                     if self._ours(hook) and hook.client_config.ca_bundle != bundle]
            if not stale:
                continue
            patch = [{"op": "replace", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle} for i in stale]
            try:
                await self._patch(name, patch)
            except ApiException as error:
                if error.status == 404:  # deleted since the list
                    log.debug("%s %s changed while patching: %s", self.kind, name, describe_error(error))
                    continue
                raise
            log.info("webhook caBundle of %s set to the CA's roots (%d webhooks)", name, len(stale))

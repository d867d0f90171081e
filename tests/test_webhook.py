"""The validating webhook: istiod's verdicts, over HTTPS with a certificate from istiod's CA."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from istiod.ca.root import CertificateAuthority
from istiod.ca.selfsigned import DirRootStore, self_signed_bundle
from istiod.ca.settings import CaSettings
from istiod.ca.signer import TtlPolicy
from istiod.settings import Address, Settings
from istiod.webhooks.serve import WebhookServer
from istiod.webhooks.validation import review
from tests.peers import Istiod, eventually

BAD_VS = {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": "bad"},
          "spec": {"hosts": ["r"], "http": [{"route": [{"destination": {"host": "r"}, "weight": -1}]}]}}
GOOD_VS = {**BAD_VS, "metadata": {"name": "good"},
           "spec": {"hosts": ["r"], "http": [{"route": [{"destination": {"host": "r"}}]}]}}


def admission(obj: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "operation": operation, "namespace": "demo", "object": obj}}


def test_verdicts() -> None:
    refused = review(admission(BAD_VS), "cluster.local")["response"]
    assert refused["uid"] == "u-1" and refused["allowed"] is False
    # The request's namespace names the object, as the API server would store it.
    assert refused["status"]["message"] == (
        "configuration is invalid: VirtualService demo/bad spec.http[0].route[0]: weight: -1 < 0")
    assert review(admission(GOOD_VS), "cluster.local")["response"] == {"uid": "u-1", "allowed": True}
    assert review(admission(BAD_VS, "DELETE"), "cluster.local")["response"]["allowed"]
    assert review(admission({"kind": "ConfigMap", "metadata": {"name": "x"}}), "cluster.local")["response"]["allowed"]
    with pytest.raises(ValueError, match="uid"):
        review({"request": {}}, "cluster.local")


def post(istiod: Istiod, body: Any, path: str = "/validate") -> tuple[int, Any]:
    context = ssl.create_default_context(cafile=str(istiod.root_cert))
    context.check_hostname = False  # the certificate names istiod's Service and 127.0.0.1 (an IP SAN)
    context.set_alpn_protocols(["h2", "http/1.1"])  # as the API server offers
    request = urllib.request.Request(f"https://127.0.0.1:{istiod.ports['webhook']}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_webhook_over_https(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    istiod = start_istiod(mesh_dir)
    status, answer = post(istiod, admission(BAD_VS))
    assert status == 200 and answer["response"]["allowed"] is False
    assert "weight: -1 < 0" in answer["response"]["status"]["message"]
    status, answer = post(istiod, admission(GOOD_VS), "/admitpilot")
    assert status == 200 and answer["response"]["allowed"] is True
    status, answer = post(istiod, {"kind": "AdmissionReview"})
    assert status == 400 and "bad AdmissionReview" in answer["detail"]



async def test_renewed_certificate_is_served_without_restart(tmp_path: Path) -> None:
    """HTTP/1.1 is what the server agrees to even when h2 is offered; a renewed certificate is
    served to the next connection."""
    ca = CertificateAuthority(await self_signed_bundle(DirRootStore(tmp_path), "cluster.local"))
    settings = Settings(None, Address("127.0.0.1", 0), Address("127.0.0.1", 0),
                        ca=CaSettings(ttl=TtlPolicy(default=timedelta(seconds=2)), reload_interval=0.05))
    webhook = WebhookServer(settings, ca, lambda: None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    serving = asyncio.create_task(webhook.serve(sock))
    client = ssl.create_default_context(cadata=ca.bundle.roots_pem)
    client.check_hostname = False
    client.set_alpn_protocols(["h2", "http/1.1"])  # as the API server offers

    async def served() -> tuple[int, str | None]:
        _, writer = await asyncio.open_connection(*sock.getsockname(), ssl=client)
        tls = writer.get_extra_info("ssl_object")
        serial = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number
        writer.close()
        return serial, tls.selected_alpn_protocol()

    async def renewed(serial: int) -> bool:
        return (await served())[0] != serial

    try:
        first, alpn = await eventually(lambda: webhook.server.started and served(), 5, "the webhook serving")
        assert alpn == "http/1.1"
        await eventually(lambda: renewed(first), 10, "the renewed certificate served")
    finally:
        webhook.server.should_exit = True
        await asyncio.wait_for(serving, 5)

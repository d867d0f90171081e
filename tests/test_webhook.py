"""The validating webhook: istiod's verdicts, over HTTPS with a certificate from istiod's CA."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import threading
import urllib.request
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from istiod.ca.root import CertificateAuthority
from istiod.ca.selfsigned import DirRootStore, self_signed_bundle
from istiod.ca.settings import CaSettings
from istiod.ca.signer import TtlPolicy
from istiod.server import Discovery
from istiod.settings import Address, Settings
from istiod.webhooks import validation
from istiod.webhooks.admission import MAX_REQUEST_BODY
from istiod.webhooks.serve import WebhookServer
from istiod.webhooks.validation import review
from istiod.xds import types
from tests.ads_client import AdsClient
from tests.peers import Istiod, eventually, wait_until

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
    # Istio's kinds this istiod does not implement: let in, with a warning naming the kind.
    wasm = {"apiVersion": "extensions.istio.io/v1alpha1", "kind": "WasmPlugin", "metadata": {"name": "x"}}
    assert review(admission(wasm), "cluster.local")["response"] == {"uid": "u-1", "allowed": True, "warnings": [
        "WasmPlugin is not implemented by this istiod: the object is kept but has no effect on any proxy"]}
    other_group = {**wasm, "apiVersion": "example.com/v1"}
    # An EnvoyFilter is validated, and admitted with istiod's warning.
    envoy_filter = {"apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
                    "metadata": {"name": "x", "namespace": "demo"},
                    "spec": {"configPatches": [{"applyTo": "CLUSTER", "patch": {"operation": "REMOVE"}}]}}
    assert review(admission(envoy_filter), "cluster.local")["response"]["warnings"] == [
        "EnvoyFilter exposes internal implementation details that may change at any time. Prefer other APIs if "
        "possible, and exercise extreme caution, especially around upgrades."]
    envoy_filter["spec"] = {"configPatches": [{"applyTo": "CLUSTER", "patch": {"operation": "MERGE"}}]}
    assert review(admission(envoy_filter), "cluster.local")["response"]["status"]["message"] == (
        "configuration is invalid: EnvoyFilter demo/x spec.configPatches[0]: "
        "Envoy filter: missing patch value for non-remove operation")
    assert review(admission(other_group), "cluster.local")["response"] == {"uid": "u-1", "allowed": True}


def post(istiod: Istiod, body: Any, path: str = "/validate") -> tuple[int, Any]:
    return post_bytes(istiod.root_cert.read_text(), istiod.ports["webhook"], json.dumps(body).encode(), path)


def post_bytes(roots: str, port: int, data: bytes, path: str = "/validate") -> tuple[int, Any]:
    context = ssl.create_default_context(cadata=roots)
    context.check_hostname = False  # the certificate names istiod's Service and 127.0.0.1 (an IP SAN)
    context.set_alpn_protocols(["h2", "http/1.1"])  # as the API server offers
    request = urllib.request.Request(f"https://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as reply:
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



@contextlib.asynccontextmanager
async def webhook_server(tmp_path: Path, **settings: Any) -> AsyncIterator[tuple[WebhookServer, int, ssl.SSLContext]]:
    """The webhook server in-process on a loopback port, and a client context that trusts it."""
    ca = CertificateAuthority(await self_signed_bundle(DirRootStore(tmp_path), "cluster.local"))
    webhook = WebhookServer(Settings(None, Address("127.0.0.1", 0), Address("127.0.0.1", 0), **settings), ca,
                            lambda: None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    serving = asyncio.create_task(webhook.serve(sock))
    client = ssl.create_default_context(cadata=ca.bundle.roots_pem)
    client.check_hostname = False
    client.set_alpn_protocols(["h2", "http/1.1"])  # as the API server offers
    try:
        await eventually(lambda: webhook.server.started, 5, "the webhook serving")
        yield webhook, sock.getsockname()[1], client
    finally:
        webhook.server.should_exit = True
        await asyncio.wait_for(serving, 5)


async def test_renewed_certificate_is_served_without_restart(tmp_path: Path) -> None:
    """HTTP/1.1 is what the server agrees to even when h2 is offered; a renewed certificate is
    served to the next connection."""
    async with webhook_server(tmp_path, ca=CaSettings(ttl=TtlPolicy(default=timedelta(seconds=2)),
                                                      reload_interval=0.05)) as (_, port, client):
        async def served() -> tuple[int, str | None]:
            _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
            tls = writer.get_extra_info("ssl_object")
            serial = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number
            writer.close()
            return serial, tls.selected_alpn_protocol()

        async def renewed(serial: int) -> bool:
            return (await served())[0] != serial

        first, alpn = await served()
        assert alpn == "http/1.1"
        await eventually(lambda: renewed(first), 10, "the renewed certificate served")


def exchange(roots: str, port: int, data: bytes) -> bytes:
    """`data` sent raw over TLS, and what comes back until the server closes."""
    context = ssl.create_default_context(cadata=roots)
    context.check_hostname = False
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain, context.wrap_socket(plain) as sock:
        sock.sendall(data)
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            while chunk := sock.recv(65536):
                reply += chunk
    return reply


HEAD = b"POST /validate HTTP/1.1\r\nHost: istiod\r\nContent-Type: application/json\r\n"
BAD_BODIES = [
    (b'{"apiVersion": 1, "request": {"uid": "u"}}', "apiVersion: expected a string"),
    (b'{"request": {"uid": "u", "namespace": ["demo"]}}', "request.namespace: expected a string"),
    (b'{"request": {"uid": "u", "operation": 7}}', "request.operation: expected a string"),
    (b'{"request": {"uid": "u", "object": "VirtualService"}}', "request.object: expected an object"),
    (b"[" * 100_000, "JSON nested too deeply"),
    (b'{"request": {"uid": "u", "object": {"spec": ' + b"[" * 5000 + b"]" * 5000 + b"}}}", "JSON nested too deeply"),
    (b'{"request": ', "Expecting value: line 1 column 13 (char 12)"),
]


def test_bad_bodies_are_refused_with_a_reason_and_no_traceback(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    istiod = start_istiod(mesh_dir)
    roots, port = istiod.root_cert.read_text(), istiod.ports["webhook"]
    for data, reason in BAD_BODIES:
        status, answer = post_bytes(roots, port, data)
        print(data[:60], status, answer)
        assert (status, answer["detail"]) == (400, f"bad AdmissionReview: {reason}")
    # A mistyped kind is not an Istio kind: allowed, as any other.
    status, answer = post(istiod, admission({"kind": ["VirtualService"], "metadata": {"name": "x"}}))
    assert status == 200 and answer["response"]["allowed"]
    # Past the cap: 413 as soon as it is known, from the length or from the bytes read.
    too_large = b"Request entity too large: limit is 3145728"
    reply = exchange(roots, port, HEAD + b"Content-Length: 67108864\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413 ") and too_large in reply, reply
    chunk = b"x" * (MAX_REQUEST_BODY + 1)
    reply = exchange(roots, port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(chunk) + chunk)
    assert reply.startswith(b"HTTP/1.1 413 ") and too_large in reply, reply[:200]
    # At the cap exactly, a review is answered.
    good = json.dumps(admission(GOOD_VS)).encode()
    status, answer = post_bytes(roots, port, good + b" " * (MAX_REQUEST_BODY - len(good)))
    assert status == 200 and answer["response"]["allowed"]
    wait_until(lambda: "bad AdmissionReview" in istiod.text(), 10, "the refusals logged")
    assert "Traceback" not in istiod.text()


async def closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await reader.read() == b""
    except (ConnectionError, ssl.SSLError):
        return True


SLOW = HEAD + b"Content-Length: 1000\r\n\r\n{"  # and the rest never comes


async def test_a_slow_body_is_cut_off_at_the_read_timeout(tmp_path: Path) -> None:
    async with webhook_server(tmp_path, http_read_timeout=0.5) as (_, port, client):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
        writer.write(SLOW)
        await writer.drain()
        try:
            assert await asyncio.wait_for(closed(reader), 10)
        finally:
            writer.close()


async def test_slow_bodies_hold_no_slot(tmp_path: Path) -> None:
    """At the connection cap, a connection still sending its body gives way to a new one."""
    async with webhook_server(tmp_path, max_connections=2) as (webhook, port, client):
        slow = [await asyncio.open_connection("127.0.0.1", port, ssl=client) for _ in range(2)]
        try:
            for _, writer in slow:
                writer.write(SLOW)
                await writer.drain()
            roots = webhook.cert.ca.bundle.roots_pem
            status, answer = await asyncio.to_thread(post_bytes, roots, port, json.dumps(admission(GOOD_VS)).encode())
            assert status == 200 and answer["response"]["allowed"]
            assert await asyncio.wait_for(closed(slow[0][0]), 10)  # the longest waiting gave way
        finally:
            for _, writer in slow:
                writer.close()


async def test_a_long_review_does_not_hold_up_ads(tmp_path: Path, mesh_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """istiod in-process: while a review is being made (held here until an ADS client has been
    served), the event loop that ADS shares keeps serving."""
    under_way, ads_served, release = threading.Event(), threading.Event(), threading.Event()
    served_during_review: list[bool] = []
    convert = validation.convert

    def held_convert(obj: Any, domain: str) -> Any:
        under_way.set()
        release.wait(15)
        served_during_review.append(ads_served.is_set())
        return convert(obj, domain)

    monkeypatch.setattr(validation, "convert", held_convert)
    loopback = Address("127.0.0.1", 0)
    discovery = Discovery(Settings(config_dir=mesh_dir, grpc_addr=loopback, http_addr=loopback,
                                   monitoring_addr=loopback, secure_grpc_addr=loopback, webhook_addr=loopback,
                                   debounce_after=0.01, poll_interval=0.05,
                                   ca=CaSettings(state_dir=tmp_path / "state", extra_sans=("127.0.0.1",))))
    client: AdsClient | None = None
    try:
        await discovery.start()
        await asyncio.wait_for(discovery.wait_synced(), 10)
        assert discovery.secure.ca is not None
        roots = discovery.secure.ca.bundle.roots_pem
        review = asyncio.ensure_future(asyncio.to_thread(post_bytes, roots, discovery.ports["webhook"],
                                                         json.dumps(admission(GOOD_VS)).encode()))
        await eventually(under_way.is_set, 10, "the review under way")
        client = AdsClient(f"127.0.0.1:{discovery.ports['grpc']}", "sidecar~127.0.0.1~probe.demo~demo.svc.cluster.local",
                           "demo")
        await client.subscribe(types.CLUSTER, [])
        ads_served.set()
        release.set()
        status, answer = await asyncio.wait_for(review, 10)
        assert status == 200 and answer["response"]["allowed"]
        assert served_during_review == [True]
    finally:
        release.set()
        if client is not None:
            await client.close()
        await discovery.stop()

"""The CertificateService and TLS xDS on istiod's secure port, in-process over real TLS gRPC:
every refusal's exact status and message, the metrics, renewal by client certificate, and that
tokens and keys never reach the log."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2
from prometheus_client import REGISTRY

from istiod.ca.pki import cert_pem, key_pem, load_certs, new_key, uri_sans
from istiod.ca.signer import TtlPolicy, issue
from istiod.gen.istio.v1.auth import ca_pb2, ca_pb2_grpc
from istiod.model.mesh import MeshConfig
from istiod.model.snapshot import Snapshot
from tests.peers import eventually
from tests.pki import csr_claiming_other_key, csr_pem, write_plugged
from tests.secure_port import OTHER_TOKEN, TOKEN, CaEndpoint, Secure, start_secure

WEB = "spiffe://cluster.local/ns/app/sa/web"
NO_CREDENTIALS = "request authenticate failure: no client certificate or bearer token is presented"


@pytest.fixture
async def secure(tmp_path: Path) -> AsyncIterator[Secure]:
    port = await start_secure(tmp_path)
    yield port
    await port.port.stop()


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def create(secure: CaEndpoint, csr: str, ttl: int = 0, **channel: object) -> ca_pb2.IstioCertificateResponse:
    async with secure.channel(**channel) as ch:  # type: ignore[arg-type]
        stub = ca_pb2_grpc.IstioCertificateServiceStub(ch)
        return await stub.CreateCertificate(ca_pb2.IstioCertificateRequest(csr=csr, validity_duration=ttl), timeout=10)


async def refusal(secure: CaEndpoint, csr: str, ttl: int = 0, **channel: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await create(secure, csr, ttl, **channel)
    print(f"refused: {refused.value.code().name}: {refused.value.details()}")
    return refused.value.code(), refused.value.details()


async def test_token_gets_a_certificate_for_its_account(secure: Secure) -> None:
    before = metric("citadel_server_success_cert_issuance_count_total")
    response = await create(secure, csr_pem(new_key()), token=TOKEN)
    leaf = load_certs(response.cert_chain[0].encode(), "leaf")[0]
    assert uri_sans(leaf) == [WEB] and response.cert_chain[-1].encode() == secure.root
    assert metric("citadel_server_success_cert_issuance_count_total") == before + 1
    root_expiry = metric("citadel_server_root_cert_expiry_timestamp")
    assert root_expiry > time.time() and metric("citadel_server_cert_chain_expiry_timestamp") > time.time()
    assert 0 < metric("citadel_server_root_cert_expiry_seconds") <= root_expiry - time.time() + 1
    assert metric("citadel_server_cert_chain_expiry_seconds") > 0


async def test_every_refusal_says_what_was_wrong(secure: Secure, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    counts = {n: metric(n) for n in ("citadel_server_csr_count_total", "citadel_server_authentication_failure_count_total",
                                     "citadel_server_csr_parsing_err_count_total")}
    ttl_errors = metric("citadel_server_csr_sign_err_count_total", error="TTL_ERROR")
    good = csr_pem(new_key())
    cases = [
        (dict(csr="garbage", token=TOKEN), grpc.StatusCode.INVALID_ARGUMENT,
         "CSR signing error (certificate signing request is not properly encoded)"),
        (dict(csr=csr_claiming_other_key(new_key(), new_key()), token=TOKEN), grpc.StatusCode.INVALID_ARGUMENT,
         "CSR signing error (certificate signing request signature does not match its public key)"),
        (dict(csr=good, ttl=2160 * 3600 + 1, token=TOKEN), grpc.StatusCode.INVALID_ARGUMENT,
         "CSR signing error (requested TTL 2160h0m1s is greater than the max allowed TTL 2160h0m0s)"),
        (dict(csr=good), grpc.StatusCode.UNAUTHENTICATED, NO_CREDENTIALS),
        (dict(csr=good, token="not-a-known-token"), grpc.StatusCode.UNAUTHENTICATED,
         "request authenticate failure: StaticTokenAuthenticator: the token is not in the static token file"),
    ]
    for args, code, message in cases:
        assert await refusal(secure, **args) == (code, message)  # type: ignore[arg-type]
    assert metric("citadel_server_csr_count_total") == counts["citadel_server_csr_count_total"] + 5
    assert metric("citadel_server_authentication_failure_count_total") == counts["citadel_server_authentication_failure_count_total"] + 2
    assert metric("citadel_server_csr_parsing_err_count_total") == counts["citadel_server_csr_parsing_err_count_total"] + 2
    assert metric("citadel_server_csr_sign_err_count_total", error="TTL_ERROR") == ttl_errors + 1
    logged = caplog.text
    assert "CSR signing error" in logged and "authentication failed" in logged
    # The log has every authenticator's reason; the caller only those of what it presented.
    assert ("ClientCertAuthenticator: no client certificate is presented; StaticTokenAuthenticator: the token is not "
            "in the static token file") in logged
    for secret in (TOKEN, "not-a-known-token", "PRIVATE KEY"):
        assert secret not in logged


async def test_renewal_with_a_client_certificate(secure: Secure) -> None:
    key = new_key()
    chain = (await create(secure, csr_pem(key), token=TOKEN)).cert_chain
    client_cert = (key_pem(key), "".join(chain[:-1]).encode())
    renewed = await create(secure, csr_pem(new_key()), cert=client_cert)  # no token: the certificate is the proof
    assert uri_sans(load_certs(renewed.cert_chain[0].encode(), "leaf")[0]) == [WEB]
    # A certificate wins over a token for another account, as in istiod's authenticator order.
    both = await create(secure, csr_pem(new_key()), cert=client_cert, token=OTHER_TOKEN)
    assert uri_sans(load_certs(both.cert_chain[0].encode(), "leaf")[0]) == [WEB]


async def test_certificate_without_an_identity_is_refused(secure: Secure) -> None:
    """Our own CA's certificate, but with no SPIFFE URI SAN (like istiod's serving certificate)."""
    key = new_key()
    bundle = secure.port.ca.bundle  # type: ignore[union-attr]
    leaf = issue(bundle, key.public_key(), [x509.DNSName("not-a-workload.example")],
                 datetime.now(timezone.utc), timedelta(hours=1))
    before = metric("citadel_server_id_extraction_err_count_total")
    code, message = await refusal(secure, csr_pem(new_key()), cert=(key_pem(key), cert_pem(leaf).encode()))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "ClientCertAuthenticator: the client certificate has no SPIFFE URI SAN" in message
    assert metric("citadel_server_id_extraction_err_count_total") == before + 1


async def test_certificate_from_another_ca_is_refused_at_the_handshake(
    secure: Secure, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = await start_secure(tmp_path / "other")
    try:
        key = new_key()
        foreign = (await create(other, csr_pem(key), token=TOKEN)).cert_chain
    finally:
        await other.port.stop()
    code, message = await refusal(secure, csr_pem(new_key()), cert=(key_pem(key), "".join(foreign[:-1]).encode()), token=TOKEN)
    # TLS 1.3: the client finishes its side before the server rejects its certificate, and asyncio aborts the
    # connection without sending the alert, so the client sees only a close or a reset; the reason is in our log.
    assert code == grpc.StatusCode.UNAVAILABLE
    assert re.fullmatch(r"failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127\.0\.0\.1:\d+: "
                        r"(Socket closed|recvmsg:Connection reset by peer \(104\))", message), message
    # The front's thread logs once start_tls raises, which can be just after the client saw the close.
    await eventually(lambda: "TLS handshake refused" in caplog.text, 5, "the refusal in the log")
    assert "client certificate not accepted (unable to get local issuer certificate)" in caplog.text


async def test_istiod_certificate_names(secure: Secure) -> None:
    """Clients reach istiod by its Service names; tests by 127.0.0.1 (--tls-extra-san)."""
    serving = secure.port.serving.cert
    assert serving is not None
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"istiod.istio-system.svc", "istiod.istio-system.svc.cluster.local", "istiod-remote.istio-system.svc",
            "istio-pilot.istio-system.svc"} <= set(names.get_values_for_type(x509.DNSName))
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


async def test_plugged_ca_reload_reaches_the_secure_port(tmp_path: Path) -> None:
    first_root, _ = write_plugged(tmp_path / "cacerts", "first")
    secure = await start_secure(tmp_path, plugged=tmp_path / "cacerts")
    try:
        chain = (await create(secure, csr_pem(new_key()), token=TOKEN)).cert_chain
        assert load_certs(chain[-1].encode(), "root")[0] == first_root and len(chain) == 3
        second_root, _ = write_plugged(tmp_path / "cacerts", "second")
        published = tmp_path / "state" / "root-cert.pem"
        for _ in range(100):
            if load_certs(published.read_bytes(), "root")[0] == second_root:
                break
            await asyncio.sleep(0.05)
        secure.root = published.read_bytes()
        # New connections get a serving certificate from the new CA, and certificates from it.
        chain = (await create(secure, csr_pem(new_key()), token=TOKEN)).cert_chain
        assert load_certs(chain[-1].encode(), "root")[0] == second_root
    finally:
        await secure.port.stop()


def ads_request(namespace: str, service_account: str) -> discovery_pb2.DiscoveryRequest:
    metadata = struct_pb2.Struct()
    metadata.update({"NAMESPACE": namespace, "SERVICE_ACCOUNT": service_account, "GENERATOR": "grpc"})
    node = base_pb2.Node(id=f"sidecar~127.0.0.5~web-1.{namespace}~{namespace}.svc.cluster.local", metadata=metadata)
    return discovery_pb2.DiscoveryRequest(node=node, type_url="type.googleapis.com/envoy.config.cluster.v3.Cluster")


async def ads_first_response(secure: Secure, request: discovery_pb2.DiscoveryRequest, delta: bool = False,  # type: ignore[no-untyped-def]
                             **channel: object):
    """The first response on the secure port, over state of the world or (`delta`) incremental xDS."""
    async with secure.channel(**channel) as ch:  # type: ignore[arg-type]
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch)
        if delta:
            stream = stub.DeltaAggregatedResources(timeout=10)
            await stream.write(discovery_pb2.DeltaDiscoveryRequest(node=request.node, type_url=request.type_url))
        else:
            stream = stub.StreamAggregatedResources(timeout=10)
            await stream.write(request)
        return await stream.read()


@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
async def test_tls_xds_checks_the_callers_identity(secure: Secure, delta: bool) -> None:
    key = new_key()
    chain = (await create(secure, csr_pem(key), token=TOKEN)).cert_chain
    cert = (key_pem(key), "".join(chain[:-1]).encode())
    response = await ads_first_response(secure, ads_request("app", "web"), delta, cert=cert)
    assert response.type_url.endswith("Cluster")
    for request, channel, code, message in (
        (ads_request("other", "web"), dict(cert=cert), grpc.StatusCode.PERMISSION_DENIED,
         f"authorization failed: no identities ([{WEB}]) matched other/web"),
        (ads_request("app", "admin"), dict(cert=cert), grpc.StatusCode.PERMISSION_DENIED,
         f"authorization failed: no identities ([{WEB}]) matched app/admin"),
        (ads_request("app", "web"), {}, grpc.StatusCode.UNAUTHENTICATED,
         NO_CREDENTIALS.replace("request authenticate failure", "authentication failure")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await ads_first_response(secure, request, delta, **channel)
        print(f"ads refused: {refused.value.code().name}: {refused.value.details()}")
        assert (refused.value.code(), refused.value.details()) == (code, message)


async def certificate_naming(secure: Secure, *uris: str) -> tuple[bytes, bytes]:
    """A client (key, chain) from our own CA naming `uris`: the TLS handshake accepts it, the rules may not."""
    key = new_key()
    assert secure.port.ca is not None
    leaf = issue(secure.port.ca.bundle, key.public_key(), [x509.UniformResourceIdentifier(u) for u in uris],
                 datetime.now(timezone.utc), timedelta(hours=1))
    return key_pem(key), cert_pem(leaf).encode()


IDENTITY_RULES = [
    (("spiffe://example.org/ns/app/sa/web",),
     "the client certificate's trust domain 'example.org' is not the mesh's 'cluster.local' or its aliases old.example"),
    ((WEB, "spiffe://cluster.local/ns/app/sa/admin"), "the client certificate has 2 URI SANs; exactly one SPIFFE "
                                                      "identity is accepted"),
    ((WEB, "https://example.com/web"), "the client certificate has 2 URI SANs; exactly one SPIFFE identity is accepted"),
    (("spiffe://cluster.local/web",), "the client certificate's URI SAN is not "
                                      "spiffe://<trust domain>/ns/<namespace>/sa/<service account>"),
]


@pytest.mark.parametrize("uris, rule", IDENTITY_RULES, ids=["other-trust-domain", "two-spiffe", "spiffe-and-https",
                                                            "not-ns-sa"])
async def test_a_client_certificate_names_one_identity_in_the_mesh(tmp_path: Path, uris: tuple[str, ...], rule: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Signed by our CA, so the handshake passes; but as xDS client (and for renewal) it is refused, naming
    the rule it broke, not what every authenticator thought."""
    mesh = Snapshot("v1", mesh=MeshConfig(trust_domain_aliases=("old.example",)))
    secure = await start_secure(tmp_path, snapshot=lambda: mesh)
    try:
        cert = await certificate_naming(secure, *uris)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await ads_first_response(secure, ads_request("app", "web"), cert=cert)
        print(f"ads refused: {refused.value.code().name}: {refused.value.details()}")
        assert (refused.value.code(), refused.value.details()) == (
            grpc.StatusCode.UNAUTHENTICATED, f"authentication failure: ClientCertAuthenticator: {rule}")
        assert await refusal(secure, csr_pem(new_key()), cert=cert) == (
            grpc.StatusCode.UNAUTHENTICATED, f"request authenticate failure: ClientCertAuthenticator: {rule}")
        # An alias of the trust domain is the mesh's own.
        alias = await certificate_naming(secure, "spiffe://old.example/ns/app/sa/web")
        assert (await ads_first_response(secure, ads_request("app", "web"), cert=alias)).type_url.endswith("Cluster")
    finally:
        await secure.port.stop()
    assert "StaticTokenAuthenticator: target JWT extraction error" in caplog.text  # the log has every reason


async def test_garbage_certificate_requests_are_invalid_argument_without_tracebacks(
    secure: Secure, caplog: pytest.LogCaptureFixture
) -> None:
    async with secure.channel(token=TOKEN) as channel:
        create_raw = channel.unary_unary("/istio.v1.auth.IstioCertificateService/CreateCertificate")
        for garbage in (b"\xff" * 10, b"\x0a\xff\xff\xff\xff\x0f", b"\x22\x05abc"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await create_raw(garbage, timeout=10)
            print(f"garbage refused: {refused.value.code().name}: {refused.value.details()}")
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (refused.value.details() or "").startswith("malformed IstioCertificateRequest: ")
        # The service still answers.
        assert (await create(secure, csr_pem(new_key()), token=TOKEN)).cert_chain
    assert "Traceback" not in caplog.text and "ERROR" not in caplog.text
    assert caplog.text.count("CA: malformed certificate request") == 1  # throttled: one line a second


async def test_short_ttl_policy(tmp_path: Path) -> None:
    secure = await start_secure(tmp_path, TtlPolicy(timedelta(seconds=60), timedelta(seconds=120)))
    try:
        assert await refusal(secure, csr_pem(new_key()), 121, token=TOKEN) == (
            grpc.StatusCode.INVALID_ARGUMENT, "CSR signing error (requested TTL 2m1s is greater than the max allowed TTL 2m0s)")
    finally:
        await secure.port.stop()


@pytest.mark.parametrize("ttl", [2**63 - 1, 10**14])
async def test_huge_ttl_is_a_ttl_error_not_a_crash(secure: Secure, ttl: int, caplog: pytest.LogCaptureFixture) -> None:
    """The proto's int64 of seconds is far beyond what a timedelta holds: refused like any TTL over the max."""
    before = metric("citadel_server_csr_sign_err_count_total", error="TTL_ERROR")
    code, message = await refusal(secure, csr_pem(new_key()), ttl, token=TOKEN)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith("CSR signing error (requested TTL ") and "greater than the max allowed TTL 2160h0m0s" in message
    assert metric("citadel_server_csr_sign_err_count_total", error="TTL_ERROR") == before + 1
    assert "Traceback" not in caplog.text

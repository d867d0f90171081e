"""Certificates on behalf of a node's workloads (ztunnel's `ImpersonatedIdentity`), over real TLS gRPC:
a node account's pod-bound token gets a workload's certificate only for an account with a pod on
its own node; every forged claim is refused with PERMISSION_DENIED naming the rule."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2

from istiod.ca.authenticate import BoundPod, Caller
from istiod.ca.nodeauth import IMPERSONATED_IDENTITY, ImpersonationDenied, NodeAuthorizer
from istiod.ca.pki import key_pem, load_certs, new_key, uri_sans
from istiod.gen.istio.v1.auth import ca_pb2, ca_pb2_grpc
from istiod.model.service import Locality
from istiod.model.snapshot import Snapshot
from istiod.model.workload import Workload
from tests.conftest import render
from tests.peers import Istiod
from tests.pki import csr_pem
from tests.secure_port import TOKEN, CaEndpoint, Secure, start_secure
from tests.test_ca_service import metric

WEB, DB = "spiffe://cluster.local/ns/app/sa/web", "spiffe://cluster.local/ns/app/sa/db"
ZTUNNEL = "zt-node-a-s3cret"
TOKENS = {
    ZTUNNEL: {"serviceAccount": "istio-system/ztunnel", "pod": "ztunnel-a", "podUID": "uid-za"},
    "zt-unbound": "istio-system/ztunnel",
    "zt-old-uid": {"serviceAccount": "istio-system/ztunnel", "pod": "ztunnel-a", "podUID": "uid-before"},
    "zt-lying-node": {"serviceAccount": "istio-system/ztunnel", "pod": "ztunnel-a", "node": "node-b"},
    "zt-gone-pod": {"serviceAccount": "istio-system/ztunnel", "pod": "ztunnel-gone"},
    "zt-ghost-node": {"serviceAccount": "istio-system/ztunnel", "pod": "ztunnel-ghost"},
    "zt-impostor": {"serviceAccount": "istio-system/ztunnel", "pod": "impostor"},
}


def pod(namespace: str, name: str, service_account: str, node: str, uid: str = "", phase: str = "Running") -> Workload:
    return Workload(name, namespace, "10.0.0.1", True, phase, (), service_account, name, "Pod", node, uid)


SNAPSHOT = Snapshot("v1", workloads={(w.namespace, w.name): w for w in (
    pod("istio-system", "ztunnel-a", "ztunnel", "node-a", "uid-za"),
    pod("istio-system", "ztunnel-ghost", "ztunnel", "node-x"),
    pod("istio-system", "impostor", "default", "node-a"),
    pod("app", "web-1", "web", "node-a"),
    pod("app", "db-1", "db", "node-b"),
    pod("app", "batch-1", "batch", "node-a", phase="Succeeded"),
)}, nodes={"node-a": Locality(), "node-b": Locality()})


@pytest.fixture
async def secure(tmp_path: Path) -> AsyncIterator[Secure]:
    port = await start_secure(tmp_path, snapshot=lambda: SNAPSHOT, tokens=TOKENS)
    yield port
    await port.port.stop()


def request(identity: object, key: object = None) -> ca_pb2.IstioCertificateRequest:
    metadata = struct_pb2.Struct()
    metadata.update({IMPERSONATED_IDENTITY: identity})
    return ca_pb2.IstioCertificateRequest(csr=csr_pem(key or new_key()), metadata=metadata)


async def call(endpoint: CaEndpoint, message: ca_pb2.IstioCertificateRequest, **channel: object) -> ca_pb2.IstioCertificateResponse:
    async with endpoint.channel(**channel) as ch:  # type: ignore[arg-type]
        return await ca_pb2_grpc.IstioCertificateServiceStub(ch).CreateCertificate(message, timeout=10)


async def refused(endpoint: CaEndpoint, message: ca_pb2.IstioCertificateRequest, **channel: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call(endpoint, message, **channel)
    print(f"refused: {error.value.code().name}: {error.value.details()}")
    return error.value.code(), error.value.details() or ""


async def test_node_account_gets_a_certificate_for_a_workload_on_its_node(secure: Secure,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    response = await call(secure, request(WEB), token=ZTUNNEL)
    assert uri_sans(load_certs(response.cert_chain[0].encode(), "leaf")[0]) == [WEB]
    assert (f"issued a certificate for {WEB} (by StaticTokenAuthenticator, on behalf of node account "
            "istio-system/ztunnel)") in caplog.text
    # Without the metadata a node account gets its own identity, as any caller.
    own = await call(secure, ca_pb2.IstioCertificateRequest(csr=csr_pem(new_key())), token=ZTUNNEL)
    assert uri_sans(load_certs(own.cert_chain[0].encode(), "leaf")[0]) == ["spiffe://cluster.local/ns/istio-system/sa/ztunnel"]


DENIED = [
    (TOKEN, DB, "caller app/web is not a trusted node account (CA_TRUSTED_NODE_ACCOUNTS: istio-system/ztunnel)"),
    (ZTUNNEL, DB, "no pod of service account app/db runs on node 'node-a'"),
    (ZTUNNEL, "spiffe://cluster.local/ns/app/sa/batch", "no pod of service account app/batch runs on node 'node-a'"),
    (ZTUNNEL, "spiffe://cluster.local/ns/app/sa/nobody", "no pod of service account app/nobody runs on node 'node-a'"),
    (ZTUNNEL, "spiffe://example.org/ns/app/sa/web",
     "impersonated identity 'spiffe://example.org/ns/app/sa/web' is not in the mesh's trust domain 'cluster.local'"),
    (ZTUNNEL, "spiffe://cluster.local/ns/app", "impersonated identity 'spiffe://cluster.local/ns/app' is not "
                                              "spiffe://<trust domain>/ns/<namespace>/sa/<service account>"),
    (ZTUNNEL, "spiffe://cluster.local/ns/App/sa/../web", "impersonated identity 'spiffe://cluster.local/ns/App/sa/../web' "
                                                        "is not spiffe://<trust domain>/ns/<namespace>/sa/<service account>"),
    (ZTUNNEL, "x" * 5000, f"impersonated identity '{'x' * 120}...' is not "
                          "spiffe://<trust domain>/ns/<namespace>/sa/<service account>"),
    ("zt-unbound", WEB, "the caller's token is not bound to a pod, so its node is unknown"),
    ("zt-old-uid", WEB, "the caller's pod istio-system/ztunnel-a has UID 'uid-za', not the token's 'uid-before'"),
    ("zt-lying-node", WEB, "the token names node 'node-b', but the caller's pod istio-system/ztunnel-a is on 'node-a'"),
    ("zt-gone-pod", WEB, "the caller's pod istio-system/ztunnel-gone is unknown"),
    ("zt-ghost-node", WEB, "the caller's node 'node-x' is unknown"),
    ("zt-impostor", WEB, "the caller's pod istio-system/impostor runs as service account 'default', not 'ztunnel'"),
]


@pytest.mark.parametrize("token, identity, reason", DENIED, ids=[reason[:40] for _, _, reason in DENIED])
async def test_forged_claims_are_denied(secure: Secure, token: str, identity: str, reason: str,
                                        caplog: pytest.LogCaptureFixture) -> None:
    before = metric("citadel_server_authentication_failure_count_total")
    assert await refused(secure, request(identity), token=token) == (
        grpc.StatusCode.PERMISSION_DENIED, f"impersonation denied: {reason}")
    assert metric("citadel_server_authentication_failure_count_total") == before + 1
    assert reason in caplog.text and token not in caplog.text and "Traceback" not in caplog.text


async def test_a_certificate_caller_cannot_impersonate(secure: Secure) -> None:
    """Renewal by client certificate carries no node binding: a node agent's certificate is no licence."""
    key = new_key()
    chain = (await call(secure, ca_pb2.IstioCertificateRequest(csr=csr_pem(key)), token=ZTUNNEL)).cert_chain
    cert = (key_pem(key), "".join(chain[:-1]).encode())
    assert await refused(secure, request(WEB), cert=cert) == (
        grpc.StatusCode.PERMISSION_DENIED, "impersonation denied: caller spiffe://cluster.local/ns/istio-system/sa/ztunnel "
                                           "is not a trusted node account (CA_TRUSTED_NODE_ACCOUNTS: istio-system/ztunnel)")


@pytest.mark.parametrize("value", [42, True, None, ["a"], {"a": "b"}])
async def test_an_impersonated_identity_that_is_not_a_string_is_invalid(secure: Secure, value: object) -> None:
    assert await refused(secure, request(value), token=ZTUNNEL) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"metadata {IMPERSONATED_IDENTITY} must be a string")


def test_nobody_impersonates_without_trusted_node_accounts() -> None:
    caller = Caller(("spiffe://cluster.local/ns/istio-system/sa/ztunnel",), "x", ("istio-system", "ztunnel"),
                    BoundPod("ztunnel-a", "uid-za"))
    assert NodeAuthorizer([("istio-system", "ztunnel")], lambda: SNAPSHOT).authorize(caller, WEB) == WEB
    with pytest.raises(ImpersonationDenied, match=r"no caller may impersonate \(CA_TRUSTED_NODE_ACCOUNTS is empty\)"):
        NodeAuthorizer([], lambda: SNAPSHOT).authorize(caller, WEB)


def test_istiod_reads_nodes_and_pods_from_its_config_dir(mesh_dir: Path, tmp_path: Path,
                                                         start_istiod: Callable[..., Istiod]) -> None:
    """The whole path as a process: pods, their nodeName and uid, and Nodes from YAML; the accounts
    from CA_TRUSTED_NODE_ACCOUNTS; a grpcio client asking as the node agent."""
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="app"))
    (mesh_dir / "nodes.yaml").write_text(render("node-pods.yaml"))
    (tmp_path / "tokens.json").write_text(json.dumps({
        "agent-s3cret": {"serviceAccount": "kube-system/node-agent", "pod": "agent-a", "podUID": "uid-agent-a"}}))
    istiod = start_istiod(mesh_dir, "--ca-static-tokens", str(tmp_path / "tokens.json"),
                          env={"CA_TRUSTED_NODE_ACCOUNTS": "istio-system/ztunnel, kube-system/node-agent"})
    endpoint = CaEndpoint(istiod.secure_address, istiod.root_cert.read_bytes())

    async def both() -> None:
        response = await call(endpoint, request(WEB), token="agent-s3cret")
        assert uri_sans(load_certs(response.cert_chain[0].encode(), "leaf")[0]) == [WEB]
        assert await refused(endpoint, request(DB), token="agent-s3cret") == (
            grpc.StatusCode.PERMISSION_DENIED, "impersonation denied: no pod of service account app/db runs on node 'node-a'")

    asyncio.run(both())
    assert "on behalf of node account kube-system/node-agent" in istiod.text()

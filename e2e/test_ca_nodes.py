"""Certificates on behalf of a node's workloads against a real kube-apiserver: a ztunnel token from
the TokenRequest API bound to its pod, reviewed by TokenReview, gets certificates only for the
service accounts with a pod on its own node; istiod runs under exactly deploy/rbac."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e.kube_objects import ISTIO_NAMESPACE, ensure_namespace
from e2e.test_ca import ensure_account, published_root, start_istiod_sa, token_for  # noqa: F401 (fixture)
from istiod.ca.authenticate import BoundPod, bound_pod
from istiod.ca.pki import load_certs, uri_sans
from tests.peers import Istiod, eventually
from tests.secure_port import CaEndpoint
from tests.test_ca_nodes import call, refused, request

NS = "e2e-ca-nodes"
WEB, DB = f"spiffe://cluster.local/ns/{NS}/sa/web", f"spiffe://cluster.local/ns/{NS}/sa/db"


async def ensure(create: Callable[[], Any]) -> None:
    try:
        await create()
    except ApiException as error:
        if error.status != 409:
            raise


def pod(name: str, account: str, node: str) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "spec": {"serviceAccountName": account, "nodeName": node,
                     "containers": [{"name": "main", "image": "demo/echo"}]}}


async def bound_token(kube: client.ApiClient, namespace: str, account: str, pod_name: str) -> str:
    """A token bound to a pod, as the kubelet mounts a projected service-account token (audience istio-ca)."""
    core = client.CoreV1Api(kube)
    uid = (await core.read_namespaced_pod(pod_name, namespace)).metadata.uid
    spec = {"audiences": ["istio-ca"], "expirationSeconds": 600,
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod_name, "uid": uid}}
    return (await core.create_namespaced_service_account_token(account, namespace, {"spec": spec})).status.token


async def test_ztunnel_gets_certificates_only_for_its_own_nodes_workloads(
    kube: client.ApiClient, start_istiod_sa: Callable[..., Istiod]
) -> None:
    core = client.CoreV1Api(kube)
    await ensure_namespace(kube, NS)
    await ensure_namespace(kube, ISTIO_NAMESPACE)
    for namespace, account in ((ISTIO_NAMESPACE, "ztunnel"), (NS, "web"), (NS, "db")):
        await ensure_account(kube, namespace, account)
    for node in ("e2e-node-a", "e2e-node-b"):
        await ensure(lambda: core.create_node({"metadata": {"name": node}}))  # noqa: B023 (awaited at once)
    await ensure(lambda: core.create_namespaced_pod(ISTIO_NAMESPACE, pod("ztunnel-e2e-a", "ztunnel", "e2e-node-a")))
    await ensure(lambda: core.create_namespaced_pod(NS, pod("web-0", "web", "e2e-node-a")))
    await ensure(lambda: core.create_namespaced_pod(NS, pod("db-0", "db", "e2e-node-b")))
    ztunnel = await bound_token(kube, ISTIO_NAMESPACE, "ztunnel", "ztunnel-e2e-a")
    unbound, web = await token_for(kube, ISTIO_NAMESPACE, "ztunnel"), await token_for(kube, NS, "web")
    # What the API server's TokenReview says of the bound token: its pod, and (Kubernetes 1.32+) its node.
    review = await client.AuthenticationV1Api(kube).create_token_review(
        client.V1TokenReview(spec=client.V1TokenReviewSpec(token=ztunnel, audiences=["istio-ca"])))
    uid = (await core.read_namespaced_pod("ztunnel-e2e-a", ISTIO_NAMESPACE)).metadata.uid
    assert bound_pod(review.status.user.extra) == BoundPod("ztunnel-e2e-a", uid, "e2e-node-a")

    istiod = start_istiod_sa("istiod-0")
    endpoint = CaEndpoint(istiod.secure_address, (await published_root(kube, NS)).encode())
    response = await call(endpoint, request(WEB), token=ztunnel)
    assert uri_sans(load_certs(response.cert_chain[0].encode(), "leaf")[0]) == [WEB]
    for token, identity, reason in (
        (ztunnel, DB, f"no pod of service account {NS}/db runs on node 'e2e-node-a'"),
        (unbound, WEB, "the caller's token is not bound to a pod, so its node is unknown"),
        (web, DB, f"caller {NS}/web is not a trusted node account (CA_TRUSTED_NODE_ACCOUNTS: istio-system/ztunnel)"),
    ):
        assert await refused(endpoint, request(identity), token=token) == (
            grpc.StatusCode.PERMISSION_DENIED, f"impersonation denied: {reason}")

    # The node agent's pod goes: its token is refused, by istiod's model (the pod is unknown) until the
    # API server's TokenReview cache (10 s) lets go of it, by TokenReview after.
    await core.delete_namespaced_pod("ztunnel-e2e-a", ISTIO_NAMESPACE, grace_period_seconds=0)

    async def refusal_after_deletion() -> tuple[grpc.StatusCode, str] | None:
        try:
            await call(endpoint, request(WEB), token=ztunnel)
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details() or ""
        return None

    code, message = await eventually(refusal_after_deletion, 15, "the deleted pod's token refused")
    print(f"after deletion: {code.name}: {message}")
    assert (code, message) == (grpc.StatusCode.PERMISSION_DENIED, "impersonation denied: the caller's pod "
                                                                  f"{ISTIO_NAMESPACE}/ztunnel-e2e-a is unknown") \
        or (code == grpc.StatusCode.UNAUTHENTICATED and "KubeJWTAuthenticator" in message)
    for secret in (ztunnel, unbound, web):
        assert secret not in istiod.text()

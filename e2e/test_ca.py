"""The CA against a real kube-apiserver, istiod running as its own ServiceAccount under exactly
deploy/rbac: tokens from the TokenRequest API get certificates (istiod agent and a direct call),
bad tokens and requests get exact refusals, the root lives in one Secret and reaches every
namespace's istio-ca-root-cert ConfigMap, written only by the elected leader."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e.harness import Cluster
from e2e.kube_objects import ISTIO_NAMESPACE, create_running_pod, ensure_namespace, pod_body, service_body
from e2e.test_rbac import istiod_kubeconfig
from istiod.ca.pki import cert_pem, load_certs, new_key, uri_sans
from istiod.ca.selfsigned import self_signed_root
from istiod.kubeapi import api_client
from istiod.leader import RECORD
from tests.peers import Istiod, Process, eventually, free_port, wait_until
from tests.pki import csr_pem
from tests.secure_port import CaEndpoint, start_secure
from tests.test_ca_service import create, metric, refusal
from tests.test_mtls import SERVICE_PORT, Workload, mtls_call, run_agent

NS = "e2e-ca"
WEB = f"spiffe://cluster.local/ns/{NS}/sa/web"
ISSUER = "https://kubernetes.default.svc.cluster.local"  # the harness's --service-account-issuer
CONFIGMAP, LEASE = "istio-ca-root-cert", "istio-namespace-controller-election"  # LEASE: the lock, a ConfigMap
# Short leader-election timings, so a takeover is seen within a second or two.
LEADER_FLAGS = ("--leader-lease-duration", "3s", "--leader-renew-deadline", "2s", "--leader-retry-period", "500ms")
DENIED = "request authenticate failure: KubeJWTAuthenticator: failed to validate the JWT from cluster 'Kubernetes': "


async def token_for(kube: client.ApiClient, namespace: str, account: str, audience: str = "istio-ca") -> str:
    """A token from the TokenRequest API (10 minutes is the shortest it issues)."""
    request = {"spec": {"audiences": [audience], "expirationSeconds": 600}}
    return (await client.CoreV1Api(kube).create_namespaced_service_account_token(account, namespace, request)).status.token


async def ensure_account(kube: client.ApiClient, namespace: str, name: str) -> client.V1ServiceAccount:
    core = client.CoreV1Api(kube)
    try:
        return await core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    except ApiException as error:
        if error.status != 409:
            raise
    return await core.read_namespaced_service_account(name, namespace)


def expired_token(cluster: Cluster, account: client.V1ServiceAccount) -> str:
    """A service-account JWT as the API server signs them, but expired an hour ago (TokenRequest will not
    issue one shorter than 10 minutes), signed RS256 with the cluster's service-account key."""
    key = serialization.load_pem_private_key(cluster.creds.sa_key.read_bytes(), password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    now, meta = int(time.time()), account.metadata
    claims = {"iss": ISSUER, "aud": ["istio-ca"], "sub": f"system:serviceaccount:{meta.namespace}:{meta.name}",
              "iat": now - 7200, "nbf": now - 7200, "exp": now - 3600,
              "kubernetes.io": {"namespace": meta.namespace, "serviceaccount": {"name": meta.name, "uid": meta.uid}}}
    signed = ".".join(_b64url(json.dumps(part).encode()) for part in ({"alg": "RS256", "typ": "JWT"}, claims))
    return f"{signed}.{_b64url(key.sign(signed.encode(), padding.PKCS1v15(), hashes.SHA256()))}"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


async def root_configmap(kube: client.ApiClient, namespace: str) -> client.V1ConfigMap | None:
    try:
        return await client.CoreV1Api(kube).read_namespaced_config_map(CONFIGMAP, namespace)
    except ApiException as error:
        if error.status != 404:
            raise
        return None


async def published_root(kube: client.ApiClient, namespace: str, root: str | None = None) -> str:
    """The root in the namespace's ConfigMap once it is there (and is `root`, if given)."""
    async def probe() -> str | None:
        configmap = await root_configmap(kube, namespace)
        published = (configmap.data or {}).get("root-cert.pem") if configmap else None
        return published if published and root in (None, published) else None

    return await eventually(probe, 10, f"the root in {namespace}/{CONFIGMAP}")


async def secret_root(kube: client.ApiClient) -> str:
    secret = await client.CoreV1Api(kube).read_namespaced_secret("istio-ca-secret", ISTIO_NAMESPACE)
    assert secret.type == "istio.io/ca-root"
    return base64.b64decode(secret.data["ca-cert.pem"]).decode()


async def ca_key(kube: client.ApiClient) -> tuple[str, str]:
    """The root's private key, as the Secret holds it and as PEM: neither may reach a log."""
    encoded = (await client.CoreV1Api(kube).read_namespaced_secret("istio-ca-secret", ISTIO_NAMESPACE)).data["ca-key.pem"]
    return encoded, base64.b64decode(encoded).decode().splitlines()[1]


async def forget_the_root(kube: client.ApiClient) -> None:
    """An empty cluster as far as the CA is concerned: no root Secret, no leader-election lock."""
    core = client.CoreV1Api(kube)
    for delete in (lambda: core.delete_namespaced_secret("istio-ca-secret", ISTIO_NAMESPACE),
                   lambda: core.delete_namespaced_config_map(LEASE, ISTIO_NAMESPACE)):
        try:
            await delete()
        except ApiException as error:
            if error.status != 404:
                raise


def leads(istiod: Istiod) -> bool:
    return f"leads ConfigMap {ISTIO_NAMESPACE}/{LEASE}" in istiod.text()


async def holder(kube: client.ApiClient) -> dict[str, Any]:
    """The leader record in istiod's lock, a ConfigMap's annotation as Istio's istiod keeps it."""
    configmap = await client.CoreV1Api(kube).read_namespaced_config_map(LEASE, ISTIO_NAMESPACE)
    return json.loads(configmap.metadata.annotations[RECORD])


@pytest.fixture
async def start_istiod_sa(cluster: Cluster, kube: client.ApiClient, tmp_path: Path,
                          processes: list[Process]) -> AsyncIterator[Callable[..., Istiod]]:
    """istiod as its own ServiceAccount, identified by the pod name it is given."""
    kubeconfig, token = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    started: list[Istiod] = []

    def start(pod: str, *extra: str) -> Istiod:
        workdir = tmp_path / pod
        workdir.mkdir(exist_ok=True)
        istiod = Istiod(workdir, "--kubeconfig", str(kubeconfig), *LEADER_FLAGS, *extra, ready_timeout=60,
                        env={"POD_NAME": pod})
        processes.append(istiod)
        started.append(istiod)
        return istiod

    yield start
    secrets = (token, *await ca_key(kube))
    for istiod in started:
        log = istiod.text()
        assert "Forbidden" not in log, "istiod needed more than deploy/rbac grants"
        assert not any(secret in log for secret in secrets)


@pytest.fixture
async def as_istiod(cluster: Cluster, kube: client.ApiClient, tmp_path: Path) -> AsyncIterator[client.ApiClient]:
    """An API client with istiod's own ServiceAccount token, for the CA in this process."""
    kubeconfig, _ = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    async with await api_client(kubeconfig) as api:
        yield api


async def test_tokens_from_the_token_request_api_get_certificates(
    kube: client.ApiClient, start_istiod_sa: Callable[..., Istiod], start_agent: Callable[..., Process], tmp_path: Path
) -> None:
    await ensure_namespace(kube, NS)
    await ensure_account(kube, NS, "web")
    istiod = start_istiod_sa("istiod-0")
    root = await published_root(kube, NS)
    assert root == await secret_root(kube)
    token = await token_for(kube, NS, "web")

    chain = (await create(CaEndpoint(istiod.secure_address, root.encode()), csr_pem(new_key()), token=token)).cert_chain
    assert uri_sans(load_certs(chain[0].encode(), "leaf")[0]) == [WEB] and chain[-1] == root

    (tmp_path / "token").write_text(token)
    (tmp_path / "root-cert.pem").write_text(root)  # as mounted from the ConfigMap
    agent = start_agent("--ca-addr", istiod.secure_address, "--ca-root-cert", str(tmp_path / "root-cert.pem"),
                        "--token-file", str(tmp_path / "token"), "--output-dir", str(tmp_path / "certs"),
                        "--bootstrap", str(tmp_path / "bootstrap.json"), "--pod-name", "web-0", "--pod-namespace", NS,
                        "--instance-ip", "127.0.0.71", "--service-account", "web")
    wait_until(lambda: (tmp_path / "bootstrap.json").exists() or agent.proc.poll() is not None, 15, "the agent's bootstrap")
    issued = load_certs((tmp_path / "certs" / "cert-chain.pem").read_bytes(), "agent's chain")
    assert [uri_sans(cert) for cert in issued] == [[WEB]]
    assert (tmp_path / "certs" / "root-cert.pem").read_text() == root
    assert token not in istiod.text() + agent.text()


async def test_every_refusal_says_what_was_wrong(
    cluster: Cluster, kube: client.ApiClient, as_istiod: client.ApiClient, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Through the real TokenReview, as istiod's ServiceAccount: exact status, message and metrics."""
    caplog.set_level(logging.DEBUG)
    await ensure_namespace(kube, NS)
    web = await ensure_account(kube, NS, "web")
    await ensure_account(kube, NS, "doomed")
    good, other_audience = await token_for(kube, NS, "web"), await token_for(kube, NS, "web", audience="other")
    # The API server caches a token it accepted for 10 s, so this one is reviewed only after the deletion.
    orphaned = await token_for(kube, NS, "doomed")
    await client.CoreV1Api(kube).delete_namespaced_service_account("doomed", NS)
    expired = expired_token(cluster, web)
    secure = await start_secure(tmp_path / "ca", api=as_istiod)
    try:
        before = {name: metric(name) for name in ("citadel_server_authentication_failure_count_total",
                                                  "citadel_server_csr_parsing_err_count_total")}
        ttl_errors = metric("citadel_server_csr_sign_err_count_total", error="TTL_ERROR")
        csr = csr_pem(new_key())
        assert uri_sans(load_certs((await create(secure, csr, token=good)).cert_chain[0].encode(), "leaf")[0]) == [WEB]
        cases: list[tuple[dict[str, object], grpc.StatusCode, str]] = [
            (dict(csr=csr, token=other_audience), grpc.StatusCode.UNAUTHENTICATED,
             DENIED + 'the service account authentication returns an error: [invalid bearer token, '
                      'token audiences ["other"] is invalid for the target audiences ["istio-ca"]]'),
            (dict(csr=csr, token=orphaned), grpc.StatusCode.UNAUTHENTICATED,
             DENIED + 'the service account authentication returns an error: [invalid bearer token, '
                      'serviceaccounts "doomed" not found]'),
            (dict(csr=csr, token=expired), grpc.StatusCode.UNAUTHENTICATED,
             DENIED + "the service account authentication returns an error: [invalid bearer token, "
                      "service account token has expired]"),
            (dict(csr=csr), grpc.StatusCode.UNAUTHENTICATED,
             "request authenticate failure: no client certificate or bearer token is presented"),
            (dict(csr="garbage", token=good), grpc.StatusCode.INVALID_ARGUMENT,
             "CSR signing error (certificate signing request is not properly encoded)"),
            (dict(csr=csr + "x" * (65536 - len(csr) + 1), token=good), grpc.StatusCode.INVALID_ARGUMENT,
             "CSR signing error (certificate signing request is 65537 bytes, over the limit of 65536)"),
            (dict(csr=csr, ttl=2160 * 3600 + 1, token=good), grpc.StatusCode.INVALID_ARGUMENT,
             "CSR signing error (requested TTL 2160h0m1s is greater than the max allowed TTL 2160h0m0s)"),
        ]
        for args, code, message in cases:
            assert await refusal(secure, **args) == (code, message)  # type: ignore[arg-type]
        # Past gRPC's own limit (4 MiB) the request never reaches the CA: 4 MiB of CSR is 5 bytes more on the wire.
        assert await refusal(secure, "x" * (4 << 20), token=good) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"SERVER: Received message larger than max ({(4 << 20) + 5} vs. 4194304)")
        assert metric("citadel_server_authentication_failure_count_total") == \
            before["citadel_server_authentication_failure_count_total"] + 4
        assert metric("citadel_server_csr_parsing_err_count_total") == before["citadel_server_csr_parsing_err_count_total"] + 2
        assert metric("citadel_server_csr_sign_err_count_total", error="TTL_ERROR") == ttl_errors + 1
    finally:
        await secure.port.stop()
    for secret in (good, other_audience, orphaned, expired, *await ca_key(kube)):
        assert secret not in caplog.text


async def test_root_configmap_in_every_namespace_and_kept_right(
    kube: client.ApiClient, start_istiod_sa: Callable[..., Istiod]
) -> None:
    core = client.CoreV1Api(kube)
    await ensure_namespace(kube, NS)
    istiod = start_istiod_sa("istiod-0")
    root = await secret_root(kube)
    for namespace in ("default", "kube-system", ISTIO_NAMESPACE, NS):
        await published_root(kube, namespace, root)
    configmap = await root_configmap(kube, NS)
    assert configmap is not None and configmap.metadata.labels == {"istio.io/config": "true"}

    await ensure_namespace(kube, "e2e-ca-later")  # created after istiod started
    await published_root(kube, "e2e-ca-later", root)

    await core.delete_namespaced_config_map(CONFIGMAP, NS)
    await published_root(kube, NS, root)

    edited = await root_configmap(kube, NS)
    assert edited is not None
    edited.data = {"root-cert.pem": "tampered", "extra": "kept"}
    await core.replace_namespaced_config_map(CONFIGMAP, NS, edited)
    await published_root(kube, NS, root)
    restored = await root_configmap(kube, NS)
    assert restored is not None and restored.data == {"root-cert.pem": root, "extra": "kept"}  # as istiod: other keys stay

    # As istiod, the namespaces of Kubernetes' own bookkeeping get none.
    for namespace in ("kube-public", "kube-node-lease"):
        assert await root_configmap(kube, namespace) is None
    assert leads(istiod)


async def test_namespaces_outside_the_discovery_selectors_get_none(
    kube: client.ApiClient, start_istiod_sa: Callable[..., Istiod]
) -> None:
    await ensure_namespace(kube, "e2e-ca-selected", {"mesh": "on"})
    await ensure_namespace(kube, "e2e-ca-unselected")
    start_istiod_sa("istiod-0", "--discovery-selector", "mesh=on")
    root = await secret_root(kube)
    await published_root(kube, "e2e-ca-selected", root)
    await asyncio.sleep(0.5)  # the queue has had its turn at every namespace
    assert await root_configmap(kube, "e2e-ca-unselected") is None
    await client.CoreV1Api(kube).patch_namespace("e2e-ca-unselected", {"metadata": {"labels": {"mesh": "on"}}})
    await published_root(kube, "e2e-ca-unselected", root)


async def test_restart_keeps_the_root(kube: client.ApiClient, start_istiod_sa: Callable[..., Istiod]) -> None:
    await ensure_namespace(kube, NS)
    await forget_the_root(kube)
    first = start_istiod_sa("istiod-0")
    root = await secret_root(kube)
    await published_root(kube, NS, root)
    first.stop()
    second = start_istiod_sa("istiod-0")
    assert await secret_root(kube) == root
    await ensure_account(kube, NS, "web")
    token = await token_for(kube, NS, "web")
    chain = (await create(CaEndpoint(second.secure_address, root.encode()), csr_pem(new_key()), token=token)).cert_chain
    assert chain[-1] == root
    assert "created a self-signed root CA" in first.text() and "created a self-signed root CA" not in second.text()


@pytest.mark.parametrize("end", ["stopped", "killed"])
async def test_two_istiods_at_once_agree_on_one_root_and_one_writer(
    kube: client.ApiClient, start_istiod_sa: Callable[..., Istiod], end: str
) -> None:
    """The leader stopped hands the lock back; killed, it leaves the lock to lapse: either way the
    other takes over, within a lease duration (3 s here) of the last renewal when killed."""
    await ensure_namespace(kube, NS)
    await ensure_account(kube, NS, "web")
    await forget_the_root(kube)
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(start_istiod_sa, ("istiod-a", "istiod-b")))
    root = await secret_root(kube)
    token = await token_for(kube, NS, "web")
    for istiod in both:  # each serves, and signs with, the one root
        chain = (await create(CaEndpoint(istiod.secure_address, root.encode()), csr_pem(new_key()), token=token)).cert_chain
        assert chain[-1] == root
    assert sum("created a self-signed root CA" in istiod.text() for istiod in both) <= 1

    wait_until(lambda: any(leads(i) for i in both), 10, "a leader")
    leader, follower = both if leads(both[0]) else both[::-1]
    assert (await holder(kube))["holderIdentity"] == ("istiod-a" if leader is both[0] else "istiod-b")
    await rewritten_by(kube, leader, follower, root)

    ended = time.monotonic()
    if end == "stopped":
        leader.stop()  # hands the lock back: the other takes over at its next try
    else:
        leader.proc.kill()
    wait_until(lambda: leads(follower), 15, "the other istiod to lead")
    took = time.monotonic() - ended
    record = await holder(kube)
    assert record["holderIdentity"] == ("istiod-b" if leader is both[0] else "istiod-a")
    await rewritten_by(kube, follower, leader, root)
    assert await secret_root(kube) == root
    print(f"leader {end}: the other leads after {took:.2f}s (lease 3s, retry 0.5s), "
          f"{record['leaderTransitions']} transitions, one root")


async def test_the_root_rotates_in_its_secret_and_reaches_every_namespace(
    kube: client.ApiClient, start_istiod_sa: Callable[..., Istiod]
) -> None:
    """A root due for rotation within seconds (100 s old of 130 s, istiod's 20% grace period) in the
    Secret, and two replicas: one rotates, the other adopts it; the Secret and every namespace's
    ConfigMap then hold the new root and the old, and workloads trusting either get both."""
    await ensure_namespace(kube, NS)
    await ensure_account(kube, NS, "web")
    await forget_the_root(kube)
    planted = self_signed_root("cluster.local", datetime.now(timezone.utc) - timedelta(seconds=100),
                               timedelta(seconds=130))
    data = {"ca-cert.pem": planted.cert, "ca-key.pem": planted.key, "cert-chain.pem": b"", "root-cert.pem": b""}
    await client.CoreV1Api(kube).create_namespaced_secret(ISTIO_NAMESPACE, {
        "metadata": {"name": "istio-ca-secret"}, "type": "istio.io/ca-root",
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()}})
    old = load_certs(planted.cert, "planted root")[0]
    flags = ("--self-signed-ca-cert-ttl", "100s", "--self-signed-root-cert-check-interval", "500ms")
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda pod: start_istiod_sa(pod, *flags), ("istiod-a", "istiod-b")))

    async def rotated() -> str | None:
        secret = await client.CoreV1Api(kube).read_namespaced_secret("istio-ca-secret", ISTIO_NAMESPACE)
        roots = base64.b64decode(secret.data.get("root-cert.pem") or "").decode()
        return roots if len(load_certs(roots.encode(), "roots") if roots else []) == 2 else None

    roots = await eventually(rotated, 30, "the rotated root in the Secret")
    new = load_certs(roots.encode(), "roots")
    print("rotated:", f"{old.serial_number:x} -> {new[0].serial_number:x}, roots in the Secret: {len(new)}")
    assert new[1] == old and new[0] != old and new[0].public_key() == old.public_key()
    assert await secret_root(kube) == cert_pem(new[0])
    for namespace in ("default", ISTIO_NAMESPACE, NS):
        await published_root(kube, namespace, roots)
    token = await token_for(kube, NS, "web")
    for istiod in both:  # each signs with the new root and hands out both, to callers trusting only the old
        ca = CaEndpoint(istiod.secure_address, planted.cert)
        chain = await eventually(lambda: _chain_ending_in(ca, token, roots), 10, "both roots from each istiod")
        assert load_certs(chain[0].encode(), "leaf")[0].issuer == new[0].subject


async def _chain_ending_in(ca: CaEndpoint, token: str, roots: str) -> list[str] | None:
    chain = list((await create(ca, csr_pem(new_key()), token=token)).cert_chain)
    return chain if chain[-1] == roots else None


async def rewritten_by(kube: client.ApiClient, writer: Istiod, idle: Istiod, root: str) -> None:
    """Delete NS's ConfigMap: `writer` puts it back, `idle` does not try."""
    line = f"created ConfigMap {NS}/{CONFIGMAP}"
    written, idle_lines = writer.text().count(line), idle.text().count("created ConfigMap")
    await client.CoreV1Api(kube).delete_namespaced_config_map(CONFIGMAP, NS)
    await published_root(kube, NS, root)
    wait_until(lambda: writer.text().count(line) == written + 1, 5, "the leader's log line")
    assert idle.text().count("created ConfigMap") == idle_lines


async def test_mtls_between_agent_certified_proxyless_peers(
    kube: client.ApiClient, start_istiod_sa: Callable[..., Istiod], start_agent: Callable[..., Process],
    start_demo: Callable[..., Process], tmp_path: Path,
) -> None:
    """tests/test_mtls.py's call, with the cluster's parts: pods and Service from the API, tokens from
    TokenRequest, the root from the ConfigMap the agents would mount."""
    await ensure_namespace(kube, "echo-ns")
    server = Workload("xecho-1", "127.0.0.81", "xecho", "", tmp_path / "server")
    client_workload = Workload("client-1", "127.0.0.82", "client", "", tmp_path / "client")
    for workload in (server, client_workload):
        await ensure_account(kube, "echo-ns", workload.service_account)
        workload.home.mkdir()
        (workload.home / "token").write_text(await token_for(kube, "echo-ns", workload.service_account))
    port = free_port(server.ip)
    server.home.joinpath("port").write_text(str(port))
    await client.CoreV1Api(kube).create_namespaced_service("echo-ns", service_body("xecho", SERVICE_PORT))
    pod = pod_body(server.pod, "xecho", port)
    pod["spec"]["serviceAccountName"] = server.service_account
    await create_running_pod(kube, "echo-ns", pod, server.ip)

    istiod = start_istiod_sa("istiod-0", "--mtls")
    root = tmp_path / "root-cert.pem"
    root.write_text(await published_root(kube, "echo-ns"))
    for workload in (server, client_workload):
        run_agent(start_agent, istiod, workload, root=root)
    mtls_call(start_demo, istiod, server, client_workload)

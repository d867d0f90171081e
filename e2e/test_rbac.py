"""istiod runs as its own ServiceAccount with exactly the documented RBAC (deploy/rbac)."""

from __future__ import annotations

from pathlib import Path

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e.harness import Cluster
from e2e.istio_crds import create_istio_object, install_crds
from e2e.kube_objects import ISTIO_NAMESPACE, ensure_namespace, service_body
from tests.peers import ROOT, Istiod, Process, wait_until
from tests.test_gateway_gen import server_credential, tls_secret

NS = "e2e-rbac"


async def apply_rbac(api: client.ApiClient) -> None:
    """deploy/rbac/istiod.yaml, once per cluster (later calls find it there)."""
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    create = {
        "ServiceAccount": lambda body: core.create_namespaced_service_account(body["metadata"]["namespace"], body),
        "ClusterRole": rbac.create_cluster_role,
        "ClusterRoleBinding": rbac.create_cluster_role_binding,
        "Role": lambda body: rbac.create_namespaced_role(body["metadata"]["namespace"], body),
        "RoleBinding": lambda body: rbac.create_namespaced_role_binding(body["metadata"]["namespace"], body),
    }
    for body in yaml.safe_load_all((ROOT / "deploy" / "rbac" / "istiod.yaml").read_text()):
        try:
            await create[body["kind"]](body)
        except ApiException as error:
            if error.status != 409:
                raise


async def istiod_kubeconfig(cluster: Cluster, api: client.ApiClient, path: Path) -> tuple[Path, str]:
    """A kubeconfig with a token of istiod's own ServiceAccount, under exactly deploy/rbac; and the token."""
    await ensure_namespace(api, ISTIO_NAMESPACE)
    await apply_rbac(api)
    token = await client.CoreV1Api(api).create_namespaced_service_account_token(
        "istiod", ISTIO_NAMESPACE, {"spec": {"expirationSeconds": 3600}})
    return token_kubeconfig(cluster, token.status.token, path), token.status.token


def token_kubeconfig(cluster: Cluster, token: str, path: Path) -> Path:
    server = cluster.apiserver
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: e2e, cluster: {{server: "{server.url}", certificate-authority: "{server.cert_dir / 'apiserver.crt'}"}}}}]
users: [{{name: istiod, user: {{token: "{token}"}}}}]
contexts: [{{name: e2e, context: {{cluster: e2e, user: istiod}}}}]
current-context: e2e
""")
    path.chmod(0o600)
    return path


async def test_informers_need_only_list_and_watch(
    cluster: Cluster, kube: client.ApiClient, tmp_path: Path, processes: list[Process]
) -> None:
    core = client.CoreV1Api(kube)
    await ensure_namespace(kube, NS)
    kubeconfig, token = await istiod_kubeconfig(cluster, kube, tmp_path / "istiod.kubeconfig")
    await core.create_namespaced_service(NS, service_body("guarded"))
    await install_crds(kube)
    _, cert, key = server_credential("secure.example.com")
    await core.create_namespaced_secret(NS, tls_secret("gateway-cert", NS, cert, key))
    await create_istio_object(kube, {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
                                     "metadata": {"name": "guarded", "namespace": NS},
                                     "spec": {"hosts": ["guarded"], "http": [{"route": [{"destination": {"host": "guarded"}}]}]}})

    istiod = Istiod(tmp_path, "--kubeconfig", str(kubeconfig), ready_timeout=60)
    processes.append(istiod)
    wait_until(lambda: any(s["hostname"] == f"guarded.{NS}.svc.cluster.local" for s in istiod.get("/debug/registryz")[1]),
               10, "the service, read with the ServiceAccount's token")
    wait_until(lambda: any(o["kind"] == "VirtualService" for o in istiod.get("/debug/configz")[1]), 10,
               "the VirtualService, read with the ServiceAccount's token")
    # Gateways' credentials: Secrets are listed and watched too, and never logged.
    wait_until(lambda: "informer Secret: listed" in istiod.text(), 10, "the Secrets, listed with the ServiceAccount's token")
    assert "Forbidden" not in istiod.text()  # (not "403": timestamps and serial numbers may hold it)
    assert token not in istiod.text()  # tokens never reach the logs
    assert key.decode().splitlines()[1] not in istiod.text()
    await core.delete_namespaced_service("guarded", NS)

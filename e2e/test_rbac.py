"""istiod runs as its own ServiceAccount with exactly the documented ClusterRole (deploy/rbac)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import yaml
from kubernetes_asyncio import client

from e2e.harness import Cluster
from e2e.kube_objects import ensure_namespace, service_body
from tests.peers import ROOT, Istiod, Process, wait_until

NS = "e2e-rbac"


async def apply_rbac(api: client.ApiClient) -> None:
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    create = {
        "ServiceAccount": lambda body: core.create_namespaced_service_account(body["metadata"]["namespace"], body),
        "ClusterRole": rbac.create_cluster_role,
        "ClusterRoleBinding": rbac.create_cluster_role_binding,
    }
    for body in yaml.safe_load_all((ROOT / "deploy" / "rbac" / "istiod.yaml").read_text()):
        await create[body["kind"]](body)


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
    await ensure_namespace(kube, "istio-system")
    await ensure_namespace(kube, NS)
    await apply_rbac(kube)
    token = await core.create_namespaced_service_account_token(
        "istiod", "istio-system", {"spec": {"expirationSeconds": 3600}})
    kubeconfig = token_kubeconfig(cluster, token.status.token, tmp_path / "istiod.kubeconfig")
    await core.create_namespaced_service(NS, service_body("guarded"))

    istiod = Istiod(tmp_path, "--kubeconfig", str(kubeconfig), ready_timeout=60)
    processes.append(istiod)
    wait_until(lambda: any(s["hostname"] == f"guarded.{NS}.svc.cluster.local" for s in istiod.get("/debug/registryz")[1]),
               10, "the service, read with the ServiceAccount's token")
    assert "API error 403" not in istiod.text() and "Forbidden" not in istiod.text()
    assert token.status.token not in istiod.text()  # tokens never reach the logs
    await core.delete_namespaced_service("guarded", NS)

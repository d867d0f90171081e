"""WorkloadGroup auto-registration and health on a real kube-apiserver, istiod under exactly
deploy/rbac: a VM's agent (`istiod agent proxy`, a real Envoy, its certificate from a TokenRequest
token) names the group; istiod creates its WorkloadEntry, the agent's readiness probe of the VM's
app decides the entry's Healthy condition and so whether another proxy's EDS has the VM; when the
agent stops, the entry is removed after the grace period. A proxy naming a group that does not
exist is refused with istiod's status."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from kubernetes_asyncio import client

from e2e.istio_crds import create_istio_object, install_crds
from e2e.kube_objects import ensure_namespace
from e2e.test_ca import ensure_account, published_root, start_istiod_sa, token_for  # noqa: F401 (a fixture)
from istiod.demo.pods import ENVOY_UID, Node, sweep
from istiod.xds import types
from tests.ads_client import AdsClient
from tests.envoy_peer import envoy_binary
from tests.peers import Istiod, Process, eventually, free_port, istio_binary, istio_source
from tests.pods import app as pod_app, requires_root, shared_dir, wait_serving

VM_IP = "127.0.0.93"
ENTRY = f"vms-{VM_IP}"


class App(http.server.BaseHTTPRequestHandler):
    """The VM's application: /ready answers 200 while `healthy`, else 503."""

    healthy = True

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if App.healthy else 503)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def app() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer((VM_IP, 0), App)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    App.healthy = True
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vm-", dir="/tmp"))  # short: Unix socket paths under it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _vm_agent(istiod: Istiod, workdir: Path, app_port: int, group: str, ns: str) -> Process:
    proxy_config = {"readinessProbe": {"httpGet": {"host": VM_IP, "port": app_port, "path": "/ready"},
                                       "periodSeconds": 1}}
    return Process([
        sys.executable, "-m", "istiod", "agent", "--ca-addr", istiod.secure_address,
        "--ca-root-cert", str(workdir / "root-cert.pem"), "--token-file", str(workdir / "token"),
        "--output-dir", str(workdir / "certs"), "--pod-name", "db-vm", "--pod-namespace", ns, "--instance-ip", VM_IP,
        "--service-account", "db",
        "proxy", "--workdir", str(workdir), "--proxy-admin-addr", f"127.0.0.1:{free_port()}",
        "--status-addr", f"127.0.0.1:{free_port()}", "--readiness-addr", f"127.0.0.1:{free_port()}",
        "--envoy-prometheus-addr", f"127.0.0.1:{free_port()}", "--termination-drain-duration", "0s",
    ], env={"ISTIO_META_GENERATOR": "grpc",  # binds nothing on the host's network
            "ISTIO_META_AUTO_REGISTER_GROUP": group, "ISTIO_META_NETWORK": "",
            "PROXY_CONFIG": json.dumps(proxy_config)}, name="vm-agent")


def _addresses(response: Any) -> list[str]:
    return sorted(e.endpoint.address.socket_address.address for r in response.resources
                  for g in endpoint_pb2.ClusterLoadAssignment.FromString(r.value).endpoints for e in g.lb_endpoints)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_vm_registers_reports_health_and_is_removed_after_it_leaves(
    kube: client.ApiClient, start_istiod_sa: Callable[..., Istiod], processes: list[Process],  # noqa: F811
    app: int, workdir: Path, monkeypatch: pytest.MonkeyPatch, workers: int,
) -> None:
    """With xDS workers (2) the VM's stream is a worker's, which tells the main process's controller."""
    NS = f"e2e-vms-{workers}"  # noqa: N806 (the cluster outlives each test: a namespace and host each)
    HOST, CLUSTER = f"db.{NS}.test", f"outbound|5432||db.{NS}.test"  # noqa: N806
    await install_crds(kube)
    await ensure_namespace(kube, NS)
    await ensure_account(kube, NS, "db")
    await create_istio_object(kube, {
        "apiVersion": "networking.istio.io/v1", "kind": "WorkloadGroup", "metadata": {"name": "vms", "namespace": NS},
        "spec": {"metadata": {"labels": {"app": "db"}}, "template": {"serviceAccount": "db", "ports": {"tcp": 5432}},
                 "probe": {"httpGet": {"port": app, "path": "/ready"}, "periodSeconds": 1}}})
    await create_istio_object(kube, {
        "apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry", "metadata": {"name": "db", "namespace": NS},
        "spec": {"hosts": [HOST], "location": "MESH_INTERNAL", "resolution": "STATIC",
                 "ports": [{"number": 5432, "name": "tcp", "protocol": "TCP"}], "workloadSelector": {"labels": {"app": "db"}}}})
    monkeypatch.setenv("PILOT_WORKLOAD_ENTRY_GRACE_PERIOD", "1s")
    istiod = start_istiod_sa("istiod-vm", "--xds-workers", str(workers))
    (workdir / "root-cert.pem").write_text(await published_root(kube, NS))
    (workdir / "token").write_text(await token_for(kube, NS, "db"))
    custom = client.CustomObjectsApi(kube)

    async def entry() -> dict[str, Any] | None:
        listed = await custom.list_namespaced_custom_object("networking.istio.io", "v1", NS, "workloadentries")
        return next((e for e in listed["items"] if e["metadata"]["name"] == ENTRY), None)

    async def healthy() -> str | None:
        found = await entry()
        conditions = ((found or {}).get("status") or {}).get("conditions") or []
        return next((c["status"] for c in conditions if c["type"] == "Healthy"), None)

    async def healthy_is(status: str) -> bool:
        return await healthy() == status

    ads = AdsClient(istiod.xds_address, f"sidecar~10.1.0.9~client.{NS}~{NS}.svc.cluster.local", NS)
    try:
        assert _addresses(await ads.subscribe(types.ENDPOINT, [CLUSTER])) == []
        agent = _vm_agent(istiod, workdir, app, "vms", NS)
        processes.append(agent)
        created = await eventually(entry, 30, "the VM's WorkloadEntry")
        print("auto-registered:", json.dumps({k: created[k] for k in ("metadata", "spec")}, default=str)[:600])
        annotations = created["metadata"]["annotations"]
        assert annotations["istio.io/autoRegistrationGroup"] == "vms"
        assert annotations["istio.io/workloadController"] == "istiod-vm" and "istio.io/connectedAt" in annotations
        assert annotations["proxy.istio.io/health-checks-enabled"] == "true"
        assert created["spec"]["address"] == VM_IP and created["spec"]["labels"]["app"] == "db"
        assert created["metadata"]["ownerReferences"][0]["name"] == "vms"

        await eventually(lambda: healthy_is("True"), 20, "Healthy True")
        pushed = await ads.receive()
        while _addresses(pushed) != [VM_IP]:
            ads.send(types.ENDPOINT, [CLUSTER], pushed)
            pushed = await ads.receive()
        ads.send(types.ENDPOINT, [CLUSTER], pushed)
        print("EDS while healthy:", _addresses(pushed))

        App.healthy = False  # the probe fails: Healthy False with the agent's message, out of EDS
        await eventually(lambda: healthy_is("False"), 20, "Healthy False")
        condition = next(c for c in (await entry())["status"]["conditions"] if c["type"] == "Healthy")  # type: ignore[index]
        print("unhealthy:", condition)
        assert "status 503" in condition["message"]
        pushed = await ads.receive()
        while _addresses(pushed):
            ads.send(types.ENDPOINT, [CLUSTER], pushed)
            pushed = await ads.receive()
        ads.send(types.ENDPOINT, [CLUSTER], pushed)

        agent.stop()  # the VM leaves: disconnected, then removed after the grace period
        assert await eventually(lambda: _gone(entry), 30, "the entry removed")
        await eventually(lambda: "cleaned up auto-registered WorkloadEntry" in istiod.text(), 10, "the clean-up logged")
    finally:
        await ads.close()

    # A proxy naming a group that does not exist is refused with istiod's status.
    refused = _vm_agent(istiod, workdir, app, "nope", NS)
    processes.append(refused)
    await eventually(lambda: f"cannot find WorkloadGroup {NS}/nope" in istiod.text(), 30, "the refusal logged")
    # The agent logs the refusal after istiod does: wait for its line too.
    await eventually(lambda: "FAILED_PRECONDITION" in refused.text() or "cannot find WorkloadGroup" in refused.text(),
                     10, "the agent told of the refusal")


async def _gone(entry: Callable[[], Any]) -> bool:
    return await entry() is None


@requires_root
async def test_istios_pilot_agent_registers_a_vm_and_reports_its_health(
    kube: client.ApiClient, start_istiod_sa: Callable[..., Istiod], processes: list[Process],  # noqa: F811
) -> None:
    """Istio's own pilot-agent, as a VM runs it (a token, the root, PROXY_CONFIG with the group's probe
    and ISTIO_META_AUTO_REGISTER_GROUP, as `istioctl x workload entry configure` writes them), in a
    network namespace whose istiod.istio-system.svc:15012 leads to ours: its WorkloadEntry is created,
    its tcpSocket probe of the VM's app makes it Healthy, and when the app stops, not."""
    ns = "e2e-vms-pilot-agent"
    await install_crds(kube)
    await ensure_namespace(kube, ns)
    await ensure_account(kube, ns, "db")
    await create_istio_object(kube, {
        "apiVersion": "networking.istio.io/v1", "kind": "WorkloadGroup", "metadata": {"name": "vms", "namespace": ns},
        "spec": {"metadata": {"labels": {"app": "db"}}, "template": {"serviceAccount": "db"},
                 "probe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}})
    # The VM sees its own namespace only (a Sidecar, as Istio advises for VMs): in full e2e runs, with every
    # earlier test's Services in view, pilot-agent's Envoy at times stayed PRE_INITIALIZING with its ~30 mTLS
    # clusters warming, never asking for EDS (they wait on the "default"/"ROOTCA" secrets of pilot-agent's own
    # SDS) while istiod had sent CDS and had it ACKed; not explained yet (the note of the change says so).
    await create_istio_object(kube, {
        "apiVersion": "networking.istio.io/v1", "kind": "Sidecar", "metadata": {"name": "default", "namespace": ns},
        "spec": {"egress": [{"hosts": ["./*"]}]}})
    istiod = start_istiod_sa("istiod-pa")
    sweep()
    node = Node()
    home = shared_dir("vm-pa-")
    try:
        vm = node.add_pod("vm", 2, {"istiod.istio-system.svc": "127.0.0.1"})
        ip = node.pod_ip(2)
        tunnel = Process([sys.executable, "-m", "istiod.demo.pods", "tunnel", "--netns", vm.name,
                          "--listen", "127.0.0.1:15012", "--to", istiod.secure_address], name="tunnel-vm")
        processes.append(tunnel)
        wait_serving(tunnel)
        application = pod_app(vm, "http-server", "--address", f"{ip}:8080", "--name", "db", name="vm-app")
        processes.append(application)
        wait_serving(application)
        # The files a VM gets: the token, the root, and the proxy image's bootstrap template.
        for path, text in ((home / "var/run/secrets/tokens/istio-token", await token_for(kube, ns, "db")),
                           (home / "var/run/secrets/istio/root-cert.pem", await published_root(kube, ns))):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        template = home / "var/lib/istio/envoy/envoy_bootstrap_tmpl.json"
        template.parent.mkdir(parents=True)
        shutil.copyfile(istio_source("tools/packaging/common/envoy_bootstrap.json"), template)
        for path in (home, *home.rglob("*")):
            os.chown(path, ENVOY_UID, ENVOY_UID)
        proxy_config = {"discoveryAddress": "istiod.istio-system.svc:15012", "binaryPath": envoy_binary(),
                        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}
        env = {"POD_NAME": "db-vm", "POD_NAMESPACE": ns, "INSTANCE_IP": ip, "SERVICE_ACCOUNT": "db",
               "ISTIO_META_AUTO_REGISTER_GROUP": "vms", "ISTIO_META_CLUSTER_ID": "Kubernetes",
               "PROXY_CONFIG": json.dumps(proxy_config), "HOME": str(home)}
        agent = Process(vm.exec_args("env", "-i", "-C", str(home), *(f"{k}={v}" for k, v in env.items()),
                                     istio_binary("pilot-agent"), "proxy", "sidecar", "--domain",
                                     f"{ns}.svc.cluster.local", uid=ENVOY_UID), name="pilot-agent-vm")
        processes.append(agent)
        custom = client.CustomObjectsApi(kube)

        async def healthy() -> str | None:
            try:
                entry = await custom.get_namespaced_custom_object("networking.istio.io", "v1", ns, "workloadentries",
                                                                  f"vms-{ip}")
            except client.exceptions.ApiException:
                return None
            conditions = (entry.get("status") or {}).get("conditions") or []
            return next((f"{c['status']} {c.get('message', '')}" for c in conditions if c["type"] == "Healthy"), "none")

        async def healthy_starts(status: str) -> str | None:
            found = await healthy()
            return found if found is not None and found.startswith(status) else None

        try:
            print("pilot-agent's entry:", await eventually(lambda: healthy_starts("True"), 60, "Healthy True"))
            assert f"auto-registered WorkloadEntry\" entry={ns}/vms-{ip} health_checks=True" in istiod.text()
            application.stop()
            print("after the app stopped:", await eventually(lambda: healthy_starts("False"), 30, "Healthy False"))
        except AssertionError:
            print(agent.log()[-3000:])
            print("entry:", await healthy())
            for path in ("ready", "stats?filter=^(cluster_manager|listener_manager|server\\.state|sds\\.|cluster\\.sds-grpc\\.upstream_cx)",
                         "config_dump?resource=dynamic_warming_clusters"):
                shown = subprocess.run(vm.exec_args("curl", "-s", "-m", "5", f"http://127.0.0.1:15000/{path}"),
                                       capture_output=True, text=True, timeout=10)
                print(f"envoy /{path}:", shown.stdout[-2000:])
            print("\n".join(line for line in istiod.text().splitlines() if "level=info" not in line)[-6000:])
            print("istiod syncz:", str(istiod.get("/debug/syncz")[1])[-3000:])
            print("istiod ads lines:", "\n".join(line for line in istiod.text().splitlines() if "ads" in line)[-3000:])
            raise
    finally:
        for process in reversed(processes):
            if process.name in ("pilot-agent-vm", "vm-app", "tunnel-vm"):
                process.stop()
        node.delete()
        shutil.rmtree(home, ignore_errors=True)

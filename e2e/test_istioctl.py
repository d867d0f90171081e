"""Istio's own istioctl against istiod, over the xDS debug types (istio.io/debug/syncz, config_dump,
istio.io/debug), with a real Envoy sidecar connected. istioctl needs a Kubernetes API for every
command (it reads webhooks, pods, and makes its token with the TokenRequest API), hence e2e.

There is no kubelet here, so istioctl's port-forward to an istiod pod (its default without
--xds-address) cannot be made; it is reached with --xds-address, as istioctl does for an istiod
outside the cluster, and through the fallback it takes when no istiod pod runs (the injection
webhook's URL names istiod's address).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.status.v3 import csds_pb2
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e.harness import Cluster
from e2e.kube_objects import ISTIO_NAMESPACE, create_running_pod, ensure_namespace, pod_body
from istiod import __version__
from tests.envoy_peer import sidecar_envoy
from tests.peers import Istiod, Process, istio_binary, wait_until

NS, POD, POD_IP = "shop", "web-1", "127.0.0.61"
SYNCZ = "istio.io/debug/syncz"


def istioctl(cluster: Cluster, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([istio_binary("istioctl"), "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


async def ensure_account(kube: client.ApiClient, namespace: str, name: str) -> None:
    try:
        await client.CoreV1Api(kube).create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    except ApiException as error:
        if error.status != 409:
            raise


@pytest.fixture
async def mesh(kube: client.ApiClient, start_istiod_kube: Callable[..., Istiod]) -> Istiod:
    """istiod, Service web (HTTP, so the sidecar has routes) with pod web-1.shop in the API, and the
    ServiceAccount istioctl makes its token for."""
    await ensure_account(kube, ISTIO_NAMESPACE, "default")
    await ensure_namespace(kube, NS)
    service = {"metadata": {"name": "web"},
               "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 8080, "targetPort": 8080}]}}
    for create in (lambda: client.CoreV1Api(kube).create_namespaced_service(NS, service),
                   lambda: create_running_pod(kube, NS, pod_body(POD, "web", 8080), POD_IP)):
        try:
            await create()
        except ApiException as error:
            if error.status != 409:
                raise
    return start_istiod_kube()


def synced(istiod: Istiod) -> bool:
    status, syncz = istiod.get("/debug/syncz")
    return status == 200 and any(s["proxy"].endswith(f"~{POD}.{NS}~{NS}.svc.cluster.local")
                                 and s["cluster_sent"] and s["cluster_sent"] == s["cluster_acked"]
                                 and s["listener_sent"] == s["listener_acked"]
                                 and s["route_sent"] and s["route_sent"] == s["route_acked"] for s in syncz)


async def test_istioctl_over_the_secure_port(cluster: Cluster, mesh: Istiod, tmp_path: Path) -> None:
    """istioctl's token (TokenRequest, istio-system/default) on 15012: proxy-status, its sync diff
    against the Envoy's own config dump, x version and x internal-debug."""
    xds = ("--xds-address", mesh.secure_address)
    with sidecar_envoy(mesh.xds_address, POD, NS, POD_IP) as envoy:
        wait_until(lambda: synced(mesh), 20, "the Envoy synced")
        status = istioctl(cluster, "proxy-status", *xds)
        assert status.returncode == 0, status.stderr
        row = next((line.split() for line in status.stdout.splitlines() if f"~{POD}.{NS}~" in line), [])
        # NAME (the node ID, as istiod's), CLUSTER, ISTIOD, VERSION, SUBSCRIBED TYPES
        assert row[1] == "Kubernetes" and row[4:] == ["4", "(CDS,LDS,EDS,RDS)"], status.stdout + status.stderr
        assert "test-1" not in status.stdout  # istioctl's own query is no proxy

        machine = istioctl(cluster, "proxy-status", *xds, "-o", "json")
        assert machine.returncode == 0, machine.stderr
        configs = json.loads(machine.stdout)["resources"]  # istiod's DiscoveryResponse, as protojson
        assert [c["node"]["id"].split("~")[2] for c in configs] == [f"{POD}.{NS}"], machine.stdout
        assert {x["configStatus"] for x in configs[0]["genericXdsConfigs"]} == {"SYNCED"}, machine.stdout

        dump = tmp_path / "envoy-config-dump.json"
        dump.write_text(envoy.get("/config_dump")[1])
        diff = istioctl(cluster, "proxy-status", f"{POD}.{NS}", *xds, "--file", str(dump))
        assert diff.returncode == 0, diff.stderr
        for kind in ("Clusters Match", "Listeners Match", "Routes Match"):
            assert kind in diff.stdout, diff.stdout

        version = istioctl(cluster, "x", "version", *xds, "-o", "json")
        assert version.returncode == 0, version.stderr
        meshinfo = json.loads(version.stdout)["meshVersion"]
        assert [(m["Component"], m["Info"]["version"]) for m in meshinfo] == [("istiod", __version__)]

        debug = istioctl(cluster, "x", "internal-debug", "syncz", *xds)
        assert debug.returncode == 0, debug.stderr
        assert f"{POD}.{NS}" in debug.stdout and '"cluster_acked"' in debug.stdout

        unknown = istioctl(cluster, "x", "internal-debug", "no-such-view", *xds)
        assert unknown.returncode == 0, unknown.stderr
        assert "404 page not found" in unknown.stdout


async def test_plaintext_port_needs_authentication_as_istiod(cluster: Cluster, kube: client.ApiClient, mesh: Istiod,
                                                             tmp_path: Path, processes: list[Process]) -> None:
    """On 15010 nobody is authenticated: istiod refuses its debug types there (ENABLE_DEBUG_ENDPOINT_AUTH)
    unless that is turned off."""
    refused = istioctl(cluster, "proxy-status", "--xds-address", mesh.xds_address, "--plaintext")
    assert refused.returncode != 0
    assert "code = Unauthenticated desc = authentication required" in refused.stderr, refused.stderr

    workdir = tmp_path / "open"
    workdir.mkdir()
    open_istiod = Istiod(workdir, "--kubeconfig", str(cluster.kubeconfig), ready_timeout=60,
                         env={"ENABLE_DEBUG_ENDPOINT_AUTH": "false"})
    processes.append(open_istiod)
    with sidecar_envoy(open_istiod.xds_address, POD, NS, POD_IP):
        wait_until(lambda: synced(open_istiod), 20, "the Envoy synced")
        status = istioctl(cluster, "proxy-status", "--xds-address", open_istiod.xds_address, "--plaintext")
        assert status.returncode == 0, status.stderr
        assert f"~{POD}.{NS}~" in status.stdout and "4 (CDS,LDS,EDS,RDS)" in status.stdout, status.stdout
        # `istio.io/debug` needs an identity whatever the variable says, as istiod's.
        debug = istioctl(cluster, "x", "internal-debug", "syncz", "--xds-address", open_istiod.xds_address,
                         "--plaintext")
        assert "code = Unauthenticated desc = authentication required" in debug.stderr, debug.stderr


async def test_webhook_address_when_no_istiod_pod_runs(cluster: Cluster, kube: client.ApiClient, mesh: Istiod) -> None:
    """Without --xds-address istioctl looks for running istiod pods to port-forward to; with none it
    dials the address of the revision's injection webhook URL (istiod outside the cluster)."""
    admission = client.AdmissionregistrationV1Api(kube)
    name = "istio-sidecar-injector-external"
    body = {
        "metadata": {"name": name, "labels": {"istio.io/rev": "default"}},
        "webhooks": [{
            "name": "sidecar-injector.istio.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "failurePolicy": "Ignore",
            "clientConfig": {"url": f"https://{mesh.secure_address}/inject"},
            "namespaceSelector": {"matchLabels": {"no-such-label": "x"}},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}],
        }],
    }
    await admission.create_mutating_webhook_configuration(body)
    try:
        with sidecar_envoy(mesh.xds_address, POD, NS, POD_IP):
            wait_until(lambda: synced(mesh), 20, "the Envoy synced")
            status = istioctl(cluster, "proxy-status", "--revision", "default")
            assert status.returncode == 0, status.stderr
            assert f"~{POD}.{NS}~" in status.stdout and "4 (CDS,LDS,EDS,RDS)" in status.stdout, status.stdout
    finally:
        await admission.delete_mutating_webhook_configuration(name)


async def test_debug_types_refused_as_istiod(kube: client.ApiClient, mesh: Istiod) -> None:
    """Bad callers on 15012 get istiod's gRPC statuses: no credentials, and a workload's identity asking
    for what only the system namespace may read."""
    configmap = await client.CoreV1Api(kube).read_namespaced_config_map("istio-ca-root-cert", ISTIO_NAMESPACE)
    root = configmap.data["root-cert.pem"].encode()
    await ensure_account(kube, NS, "web")
    token = (await client.CoreV1Api(kube).create_namespaced_service_account_token(
        "web", NS, {"spec": {"audiences": ["istio-ca"], "expirationSeconds": 600}})).status.token

    def request(type_url: str, names: list[str], namespace: str, account: str) -> discovery_pb2.DiscoveryRequest:
        request = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names)
        request.node.id = f"sidecar~127.0.0.1~istioctl.{namespace}~{namespace}.svc.cluster.local"
        request.node.metadata.update({"GENERATOR": "event", "NAMESPACE": namespace, "SERVICE_ACCOUNT": account})
        return request

    def channel(token: str | None) -> grpc.aio.Channel:
        credentials = grpc.ssl_channel_credentials(root)
        if token is not None:
            credentials = grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(token))
        return grpc.aio.secure_channel(mesh.secure_address, credentials)

    async def ask(type_url: str, names: list[str], namespace: str, account: str,
                  token: str | None) -> grpc.aio.AioRpcError:
        async with channel(token) as open_channel:
            stream = ads_pb2_grpc.AggregatedDiscoveryServiceStub(open_channel).StreamAggregatedResources(
                iter([request(type_url, names, namespace, account)]))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stream:
                    pass
            return refused.value

    async def syncz(namespace: str, account: str, token: str) -> list[str]:
        """The proxies istio.io/debug/syncz shows this caller."""
        async with channel(token) as open_channel:
            stream = ads_pb2_grpc.AggregatedDiscoveryServiceStub(open_channel).StreamAggregatedResources()
            await stream.write(request(SYNCZ, [], namespace, account))
            response = await stream.read()
            stream.cancel()
        assert response.type_url == SYNCZ and json.loads(response.control_plane.identifier)["Component"] == "istiod"
        return [csds_pb2.ClientConfig.FromString(r.value).node.id.split("~")[2] for r in response.resources]

    anonymous = await ask(SYNCZ, [], ISTIO_NAMESPACE, "default", None)
    assert anonymous.code() is grpc.StatusCode.UNAUTHENTICATED
    assert anonymous.details().startswith("authentication failure"), anonymous.details()

    workload = await ask("istio.io/debug", ["syncz"], NS, "web", token)
    assert workload.code() is grpc.StatusCode.PERMISSION_DENIED
    assert workload.details() == 'the debug info is not available for current identity: "ns/shop/sa/web"'

    two = await ask("istio.io/debug", ["syncz", "adsz"], NS, "web", token)
    assert (two.code(), two.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "exactly one debug request is required")

    # A workload's identity sees its own namespace's proxies only; istiod's namespace sees all.
    await ensure_namespace(kube, "other")
    await ensure_account(kube, "other", "default")
    other = (await client.CoreV1Api(kube).create_namespaced_service_account_token(
        "default", "other", {"spec": {"audiences": ["istio-ca"], "expirationSeconds": 600}})).status.token
    system = (await client.CoreV1Api(kube).create_namespaced_service_account_token(
        "default", ISTIO_NAMESPACE, {"spec": {"audiences": ["istio-ca"], "expirationSeconds": 600}})).status.token
    with sidecar_envoy(mesh.xds_address, POD, NS, POD_IP):
        wait_until(lambda: synced(mesh), 20, "the Envoy synced")
        assert await syncz(NS, "web", token) == [f"{POD}.{NS}"]
        assert await syncz("other", "default", other) == []
        assert await syncz(ISTIO_NAMESPACE, "default", system) == [f"{POD}.{NS}"]


async def test_unclean_paths_redirect_as_go(mesh: Istiod) -> None:
    """istioctl version asks the monitoring port for `//version` (through a port-forward, which needs a
    kubelet); Go's ServeMux answers 301 to `/version`, and so do the HTTP ports here."""
    monitoring = f"http://127.0.0.1:{mesh.ports['monitoring']}"
    with urllib.request.urlopen(f"{monitoring}//version", timeout=5) as reply:  # follows the 301
        assert reply.url == f"{monitoring}/version"
        assert json.loads(reply.read())["version"] == __version__

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: object, **kwargs: object) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    for port, path, location in (("http", "/debug/../ready", "/ready"), ("http", "//debug//syncz?x=1", "/debug/syncz?x=1")):
        with pytest.raises(urllib.error.HTTPError) as moved:
            opener.open(f"http://127.0.0.1:{mesh.ports[port]}{path}", timeout=5)
        assert (moved.value.code, moved.value.headers["location"]) == (301, location)

"""Every debug endpoint, on the http (8080) and monitoring (15014) ports, with real gRPC peers connected."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from istiod.debug.app import DEBUG_ENDPOINTS
from istiod.xds import types
from tests.conftest import CLIENT_PROXY, ECHO_HOST, ECHO_PORT, SERVER_PROXY, Mesh, render
from tests.ads_client import AdsClient
from tests.peers import Istiod, eventually, wait_until

CLUSTER = f"outbound|{ECHO_PORT}||{ECHO_HOST}"
PORTS = ("http", "monitoring")


def get_json(istiod: Istiod, path: str, port: str) -> Any:
    status, body = istiod.get(path, port)
    assert status == 200, (path, port, status, body)
    return body


@pytest.mark.parametrize("port", PORTS)
def test_index_links_every_endpoint(synced_mesh: Mesh, port: str) -> None:
    status, page = synced_mesh.istiod.get("/debug", port)
    assert status == 200 and page.startswith("<!doctype html>")
    for path, description in DEBUG_ENDPOINTS.items():
        assert f'<a href="{path}">' in page and description.split(",")[0] in page
    assert ('href="/metrics"' in page) == (port == "monitoring")


@pytest.mark.parametrize("port", PORTS)
def test_registry_endpoints_instances_and_config(synced_mesh: Mesh, port: str) -> None:
    istiod = synced_mesh.istiod
    services = get_json(istiod, "/debug/registryz", port)
    assert [s["hostname"] for s in services] == [ECHO_HOST]
    assert services[0]["ports"] == [{"name": "grpc", "port": ECHO_PORT, "protocol": "TCP", "targetPort": "grpc"}]

    endpoints = get_json(istiod, "/debug/endpointz", port)
    assert endpoints == {ECHO_HOST: {str(ECHO_PORT): [{
        "address": "127.0.0.21", "port": synced_mesh.server_port, "healthy": True,
        "locality": "", "workload": "echo", "workloadKind": "Deployment", "serviceAccount": "echo", "pod": "echo-a",
    }]}}

    workloads = {w["name"]: w for w in get_json(istiod, "/debug/instancesz", port)}
    assert workloads["echo-a"]["workloadKind"] == "Deployment"
    assert workloads["echo-a"]["owner"] == {"kind": "ReplicaSet", "name": "echo-6d4cf56db6"}
    report = workloads["report-29412360-7xk2d"]
    assert report["job"] == {"name": "report-29412360", "finished": True}
    assert report["cronJob"] == {"name": "report", "schedule": "*/30 * * * *", "suspended": False}
    assert report["volumes"] == [{"persistentVolume": "pv-report", "claim": "report-data", "capacity": "10Gi", "capacityBytes": 10 * 2**30,
                                  "accessModes": ["ReadWriteOnce"], "storageClass": "standard", "phase": "Bound"}]

    objects = get_json(istiod, "/debug/configz", port)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Service", "echo"), ("Pod", "echo-a"), ("CronJob", "report"), ("PersistentVolume", "pv-report")} <= kinds


@pytest.mark.parametrize("port", PORTS)
def test_connected_proxies_and_their_sync_state(synced_mesh: Mesh, port: str) -> None:
    istiod = synced_mesh.istiod
    adsz = get_json(istiod, "/debug/adsz", port)
    assert adsz["totalClients"] == 2
    clients = {c["proxy"]: c for c in adsz["clients"]}
    client = clients[CLIENT_PROXY]
    assert client["address"].startswith("127.0.0.1:") and client["connectedAt"].endswith("Z")
    assert client["connectionId"].startswith(CLIENT_PROXY + "-")
    assert client["metadata"]["NAMESPACE"] == "echo-ns" and client["metadata"]["GENERATOR"] == "grpc"
    assert client["watches"] == {
        "type.googleapis.com/envoy.config.cluster.v3.Cluster": [CLUSTER],
        "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment": [CLUSTER],
        "type.googleapis.com/envoy.config.listener.v3.Listener": [f"{ECHO_HOST}:{ECHO_PORT}"],
        "type.googleapis.com/envoy.config.route.v3.RouteConfiguration": [CLUSTER],  # istiod names it so
    }
    assert clients[SERVER_PROXY]["watches"] == {
        "type.googleapis.com/envoy.config.listener.v3.Listener": [
            f"xds.istio.io/grpc/lds/inbound/127.0.0.21:{synced_mesh.server_port}"],
    }

    connections = get_json(istiod, "/debug/connections", port)
    assert connections["totalClients"] == 2
    assert {c["proxy"] for c in connections["clients"]} == {CLIENT_PROXY, SERVER_PROXY}
    assert all("metadata" not in c and c["watches"] and c["address"] for c in connections["clients"])

    syncz = {s["proxy"]: s for s in get_json(istiod, "/debug/syncz", port)}
    for prefix in ("cluster", "listener", "route", "endpoint"):
        assert syncz[CLIENT_PROXY][f"{prefix}_sent"] == syncz[CLIENT_PROXY][f"{prefix}_acked"] != ""
    assert syncz[SERVER_PROXY]["cluster_sent"] == "" and syncz[SERVER_PROXY]["listener_acked"]
    assert syncz[CLIENT_PROXY]["cluster_id"] == "Kubernetes" and syncz[CLIENT_PROXY]["proxy_type"] == "sidecar"


def test_push_status_reports_the_last_push(synced_mesh: Mesh) -> None:
    istiod = synced_mesh.istiod
    before = get_json(istiod, "/debug/push_status", "http")
    (synced_mesh.dir / "pod-b.yaml").write_text(
        render("pod.yaml", pod="echo-b", app="echo", namespace="echo-ns", ip="127.0.0.22", port=7071))

    def pushed() -> dict | None:
        status = get_json(istiod, "/debug/push_status", "monitoring")
        return status if status["version"] != before["version"] and not status["in_progress"] else None

    status = wait_until(pushed, 5, "a push of the new pod to finish")
    assert status["reason"] == {"Pod": 1} and status["full"] is False
    assert status["proxies_connected"] == 2
    assert status["proxies_pushed"] == 1  # the client's EDS changed; the server's listener did not
    assert status["responses_sent"] == 1
    assert status["errors"] == []
    assert 0 <= status["duration_seconds"] < 5 and status["start"] <= status["end"]
    assert 0 <= status["debounce_seconds"] and 0 <= status["build_seconds"]


async def test_push_status_and_config_dump_show_a_nack(
    synced_mesh: Mesh, ads_client: Callable[..., AdsClient]
) -> None:
    istiod = synced_mesh.istiod
    nacker = ads_client(istiod, "nacker", "echo-ns")
    await nacker.subscribe(types.CLUSTER, [CLUSTER], nack="cluster rejected")
    await eventually(lambda: get_json(istiod, "/debug/push_status", "http")["errors"], 5, "the NACK in push_status")
    assert get_json(istiod, "/debug/push_status", "http")["errors"] == [
        {"proxy": nacker.node.id, "type": "cds", "message": "cluster rejected"}]
    # istiod's dump always has clusters, listeners and routes (empty when not watched).
    clusters, listeners, routes = get_json(istiod, "/debug/config_dump?proxyID=nacker.echo-ns", "http")["configs"]
    assert [listeners["@type"], routes["@type"]] == [
        "type.googleapis.com/envoy.admin.v3.ListenersConfigDump", "type.googleapis.com/envoy.admin.v3.RoutesConfigDump"]
    [cluster] = clusters["dynamic_active_clusters"]
    assert cluster["client_status"] == "NACKED" and cluster["error_state"]["details"] == "cluster rejected"
    assert cluster["error_state"]["version_info"] == cluster["version_info"]


@pytest.mark.parametrize("port", PORTS)
def test_config_dump_holds_what_the_proxy_was_sent(synced_mesh: Mesh, port: str) -> None:
    istiod = synced_mesh.istiod
    dump = get_json(istiod, "/debug/config_dump?proxyID=demo-client.echo-ns", port)
    assert dump == get_json(istiod, f"/debug/config_dump?proxyID={CLIENT_PROXY}", port)
    configs = {c["@type"].rsplit(".", 1)[1]: c for c in dump["configs"]}
    assert list(configs) == ["ClustersConfigDump", "ListenersConfigDump", "RoutesConfigDump", "EndpointsConfigDump"]
    [cluster] = configs["ClustersConfigDump"]["dynamic_active_clusters"]
    assert cluster["cluster"]["name"] == CLUSTER and cluster["cluster"]["type"] == "EDS"
    assert cluster["client_status"] == "ACKED" and cluster["version_info"] and cluster["last_updated"]
    [listener] = configs["ListenersConfigDump"]["dynamic_listeners"]
    manager = listener["active_state"]["listener"]["api_listener"]["api_listener"]
    assert manager["@type"].endswith("HttpConnectionManager")
    assert manager["rds"]["route_config_name"] == CLUSTER
    [route] = configs["RoutesConfigDump"]["dynamic_route_configs"]
    assert route["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] == CLUSTER
    [assignment] = configs["EndpointsConfigDump"]["dynamic_endpoint_configs"]
    endpoint = assignment["endpoint_config"]["endpoints"][0]["lb_endpoints"][0]
    assert endpoint["endpoint"]["address"]["socket_address"]["address"] == "127.0.0.21"
    assert endpoint["health_status"] == "HEALTHY"

    diff = get_json(istiod, "/debug/sync_diff?proxyID=demo-client.echo-ns", port)
    assert [(t["type"], t["status"]) for t in diff["types"]] == [
        ("cds", "SYNCED"), ("lds", "SYNCED"), ("eds", "SYNCED"), ("rds", "SYNCED")]
    assert all(not (t["sent_not_acked"] or t["acked_not_sent"] or t["changed"]) for t in diff["types"])


@pytest.mark.parametrize("path", ["/debug/config_dump", "/debug/sync_diff"])
def test_proxy_queries_are_checked(synced_mesh: Mesh, path: str) -> None:
    istiod = synced_mesh.istiod
    assert istiod.get(path) == (400, {"error": "you must provide a proxyID in the query string"})
    assert istiod.get(f"{path}?proxyID=") == (400, {"error": "you must provide a proxyID in the query string"})
    assert istiod.get(f"{path}?proxyID=nobody.nowhere") == (
        404, {"error": "proxy 'nobody.nowhere' is not connected to this istiod"})


def test_probes_metrics_and_version(synced_mesh: Mesh) -> None:
    istiod = synced_mesh.istiod
    for port in PORTS:
        assert istiod.get("/ready", port) == (200, "ready\n")
        assert istiod.get("/healthz", port) == (200, "ok\n")
        assert istiod.get("/debug/nothing-here", port) == (404, {"error": "Not Found"})
    status, text = istiod.get("/metrics", "monitoring")
    assert status == 200 and "# TYPE pilot_xds_pushes counter" in text
    assert get_json(istiod, "/version", "monitoring")["version"] == "0.1.0"
    assert istiod.get("/metrics", "http")[0] == 404 and istiod.get("/version", "http")[0] == 404

"""The sidecar generator with a real Envoy 1.40 on istiod's plaintext xDS port: Envoy ACKs every
type, and its own /config_dump holds Istio's listeners, clusters, endpoints and routes."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import DATA, synced
from tests.envoy_peer import Envoy, node_id, sidecar_envoy
from tests.peers import Istiod, wait_until

WEB = "web.shop.svc.cluster.local"
PROXY = node_id("web-1", "shop", "127.0.0.31")
TYPES = ("cluster", "listener", "endpoint", "route")


def _mesh(mesh_dir: Path) -> None:
    shutil.copy(DATA / "sidecar-mesh.yaml", mesh_dir / "mesh.yaml")


def _dynamic(dump: dict[str, Any], kind: str) -> dict[str, Any]:
    """name -> resource, for the active dynamic resources of one dump kind."""
    if kind == "listeners":
        return {e["name"]: e["active_state"]["listener"]
                for e in dump["ListenersConfigDump"].get("dynamic_listeners", []) if "active_state" in e}
    if kind == "clusters":
        return {e["cluster"]["name"]: e["cluster"] for e in dump["ClustersConfigDump"].get("dynamic_active_clusters", [])}
    if kind == "routes":
        return {e["route_config"]["name"]: e["route_config"]
                for e in dump["RoutesConfigDump"].get("dynamic_route_configs", [])}
    return {e["endpoint_config"]["cluster_name"]: e["endpoint_config"]
            for e in dump["EndpointsConfigDump"].get("dynamic_endpoint_configs", [])}


def _acked(istiod: Istiod, envoy: Envoy) -> None:
    try:
        wait_until(lambda: synced(istiod, PROXY, TYPES), 20, "Envoy to ACK every type")
    except AssertionError:
        raise AssertionError(f"syncz: {istiod.get('/debug/syncz')[1]}\nEnvoy:\n{envoy.log()[-6000:]}") from None


def test_envoy_acks_istios_sidecar_layout(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    _mesh(mesh_dir)
    istiod = start_istiod(mesh_dir)
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as envoy:
        _acked(istiod, envoy)
        wait_until(lambda: envoy.get("/ready")[0] == 200, 10, "Envoy ready (listeners warmed)")
        dump = envoy.config_dump()
        listeners = _dynamic(dump, "listeners")
        assert {"virtualOutbound", "virtualInbound", "0.0.0.0_80", "0.0.0.0_7070", "10.96.0.11_5432"} <= set(listeners)
        assert not any(name.endswith("_53") for name in listeners)  # UDP passes by the sidecar
        clusters = _dynamic(dump, "clusters")
        assert {f"outbound|80||{WEB}", "outbound|5432||db.shop.svc.cluster.local", "BlackHoleCluster",
                "PassthroughCluster", "InboundPassthroughCluster", "inbound|8080||"} <= set(clusters)
        assert clusters["inbound|8080||"]["upstream_bind_config"]["source_address"]["address"] == "127.0.0.6"
        endpoints = _dynamic(dump, "endpoints")
        web = endpoints[f"outbound|80||{WEB}"]["endpoints"][0]["lb_endpoints"][0]
        assert web["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.31", "port_value": 8080}
        assert web["metadata"]["filter_metadata"]["envoy.transport_socket_match"] == {"tlsMode": "istio"}
        routes = _dynamic(dump, "routes")
        hosts = {h["name"]: h for h in routes["80"]["virtual_hosts"]}
        assert set(hosts[f"{WEB}:80"]["domains"]) == {
            WEB, f"{WEB}:80", "web.shop.svc", "web.shop.svc:80", "web.shop", "web.shop:80", "web", "web:80",
            "10.96.0.10", "10.96.0.10:80"}
        assert hosts["allow_any"]["routes"][0]["route"]["cluster"] == "PassthroughCluster"
        print("Envoy printed:\n" + envoy.log()[-3000:])

"""Multi-network with real Envoys: a sidecar in network n1 calls a service whose only endpoint is a
WorkloadEntry in network n2. istiod sends the sidecar n2's east-west gateway (meshNetworks) instead
of the endpoint; the gateway (an Istio Gateway with AUTO_PASSTHROUGH on 15443, in network n2) passes
the sidecar's mTLS through by its SNI to the backend, which sees the caller's mesh identity. A
plaintext endpoint in n2 is not sent (the gateway routes mTLS only)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec

from istiod.ca.pki import cert_pem, key_pem
from tests.envoy_peer import Envoy, sidecar_envoy
from tests.peers import Istiod, Process, wait_until
from tests.pki import leaf_cert
from tests.test_envoy_sidecar import captured_pod

ECHO_VIP, PLAIN_VIP = "10.96.0.30", "10.96.0.31"
BACKEND, PLAIN, GATEWAY = "127.0.0.62", "127.0.0.63", "127.0.0.81"
ECHO_CLUSTER = "outbound|80||echo.shop.svc.cluster.local"
PLAIN_CLUSTER = "outbound|80||plain.shop.svc.cluster.local"


def _service(name: str, vip: str) -> dict[str, Any]:
    return {"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry", "metadata": {"name": name, "namespace": "shop"},
            "spec": {"hosts": [f"{name}.shop.svc.cluster.local"], "addresses": [vip], "location": "MESH_INTERNAL",
                     "resolution": "STATIC", "workloadSelector": {"labels": {"app": name}},
                     "ports": [{"number": 80, "name": "http", "protocol": "HTTP", "targetPort": 8443}]}}


def _entry(name: str, address: str, app: str, service_account: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {"address": address, "network": "n2", "labels": {"app": app}}
    if service_account:  # a mesh workload (tlsMode istio)
        spec["serviceAccount"] = service_account
    return {"apiVersion": "networking.istio.io/v1", "kind": "WorkloadEntry", "metadata": {"name": name, "namespace": "shop"},
            "spec": spec}


OBJECTS = [
    _service("echo", ECHO_VIP), _entry("echo-n2", BACKEND, "echo", "echo"),
    _service("plain", PLAIN_VIP), _entry("plain-n2", PLAIN, "plain"),
    {"apiVersion": "networking.istio.io/v1", "kind": "Gateway", "metadata": {"name": "cross-network", "namespace": "istio-system"},
     "spec": {"selector": {"istio": "eastwestgateway"}, "servers": [
         {"port": {"number": 15443, "name": "tls", "protocol": "TLS"}, "hosts": ["*.local"],
          "tls": {"mode": "AUTO_PASSTHROUGH"}}]}},
]
MESH = f"meshNetworks: {{networks: {{n2: {{gateways: [{{address: {GATEWAY}, port: 15443}}]}}}}}}\n"


@dataclass
class Mesh:
    client: Envoy
    gateway: Envoy
    run: Callable[..., Any]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (Debian's package) for the capture rules")
    workdir = tmp_path_factory.mktemp("multinetwork")
    config = workdir / "mesh"
    config.mkdir()
    (config / "objects.yaml").write_text(yaml.safe_dump_all(OBJECTS))
    (workdir / "meshconfig.yaml").write_text(MESH)
    istiod = Istiod(workdir, "--config-dir", str(config), "--mesh-config", str(workdir / "meshconfig.yaml"),
                    "--poll-interval", "100ms")
    try:
        with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web",
                           metadata={"NETWORK": "n1"}) as client, captured_pod(istiod, client) as run:
            for vip in (ECHO_VIP, PLAIN_VIP):
                assert run("ip", "addr", "add", f"{vip}/32", "dev", "lo").returncode == 0
            # The backend's certificate, of the client's mesh root, for the WorkloadEntry's service account.
            assert client.sds is not None
            key = ec.generate_private_key(ec.SECP256R1())
            (workdir / "echo.pem").write_text(cert_pem(leaf_cert(key, (client.sds.root, client.sds.root_key),
                                                                 uris=("spiffe://cluster.local/ns/shop/sa/echo",))))
            (workdir / "echo-key.pem").write_bytes(key_pem(key))
            (workdir / "root.pem").write_text(cert_pem(client.sds.root))
            backend = Process(client.netns(sys.executable, "tests/tls_echo.py", BACKEND, "8443", str(workdir / "echo.pem"),
                                           str(workdir / "echo-key.pem"), "echo", str(workdir / "root.pem")), name="echo")
            try:
                # The east-west gateway of n2 (in the client's namespace: its loopback is the test's network).
                with sidecar_envoy(istiod.xds_address, "eastwest-1", "istio-system", GATEWAY, service_account="eastwest",
                                   metadata={"NETWORK": "n2", "LABELS": {"istio": "eastwestgateway"}},
                                   router=True, inside=client) as gateway:
                    wait_until(lambda: gateway.get("/ready")[0] == 200, 20, "the gateway's listeners warm")
                    yield Mesh(client, gateway, run)
            finally:
                backend.stop()
    finally:
        istiod.stop()


def _endpoints(envoy: Envoy, cluster: str) -> list[str]:
    for entry in envoy.config_dump().get("EndpointsConfigDump", {}).get("dynamic_endpoint_configs", []):
        if entry["endpoint_config"]["cluster_name"] == cluster:
            return sorted(f"{e['endpoint']['address']['socket_address']['address']}:"
                          f"{e['endpoint']['address']['socket_address']['port_value']}"
                          for group in entry["endpoint_config"].get("endpoints", []) for e in group.get("lb_endpoints", []))
    return []


def test_call_to_another_network_goes_through_its_gateway_over_mtls(mesh: Mesh) -> None:
    # The client (n1) is sent n2's gateway, never the workload's own address.
    assert wait_until(lambda: _endpoints(mesh.client, ECHO_CLUSTER) == [f"{GATEWAY}:15443"], 10, "the gateway in EDS")
    # The gateway (in n2) reaches the workload directly (its SNI cluster reads the service's EDS).
    wait_until(lambda: _endpoints(mesh.gateway, ECHO_CLUSTER) == [f"{BACKEND}:8443"], 10, "the gateway's EDS")

    def call() -> str:
        done = mesh.run("curl", "-s", "--max-time", "5", "-H", "Host: echo.shop.svc.cluster.local",
                        f"http://{ECHO_VIP}/cross")
        return done.stdout if done.returncode == 0 and done.stdout.startswith("{") else ""

    body = wait_until(call, 15, "the call across networks")
    print("n1 -> n2 through the east-west gateway:", body)
    # The backend saw the client's mesh identity: mTLS end to end, the gateway only passed it through.
    assert json.loads(body) == {"name": "echo", "path": "/cross", "peer": "spiffe://cluster.local/ns/shop/sa/web"}
    stats = mesh.gateway.get("/stats?filter=outbound_.80_._.echo.shop.svc.cluster.local.upstream_cx_total")[1]
    print("gateway:", stats.strip())
    assert int(stats.strip().rsplit(" ", 1)[-1]) >= 1


def test_plaintext_endpoint_of_another_network_is_not_sent(mesh: Mesh) -> None:
    wait_until(lambda: _endpoints(mesh.client, ECHO_CLUSTER), 10, "EDS")
    assert _endpoints(mesh.client, PLAIN_CLUSTER) == []
    assert _endpoints(mesh.gateway, PLAIN_CLUSTER) == [f"{PLAIN}:8443"]  # in n2 it is

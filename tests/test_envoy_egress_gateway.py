"""An egress gateway with TLS origination, as Istio's task sets it up, with real Envoys: a captured
sidecar's plain HTTP call to an external host (a ServiceEntry) is routed by the VirtualService's
`mesh` rule to the egress gateway over ISTIO_MUTUAL (the DestinationRule's subset, with the external
host as SNI); the gateway's ISTIO_MUTUAL server terminates that mTLS and its `istio-egressgateway` rule
routes to the external host's port 443, where the second DestinationRule originates TLS (SIMPLE) to
the external HTTPS server. The external server sees the request; the gateway's stats show both hops."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from tests.envoy_peer import Envoy, sidecar_envoy
from tests.peers import Istiod, Process, wait_until
from tests.test_envoy_sidecar import captured_pod
from tests.test_gateway_gen import server_credential

EXTERNAL_HOST, EXTERNAL_VIP, EXTERNAL_IP = "api.external.test", "10.96.9.9", "127.0.0.86"
GATEWAY_HOST, GATEWAY_IP = "istio-egressgateway.istio-system.svc.cluster.local", "127.0.0.85"
GATEWAY_ID = "spiffe://cluster.local/ns/istio-system/sa/egress"


def _objects(ca: Path) -> list[dict[str, Any]]:
    networking = "networking.istio.io/v1"
    return [
        # The external service: plain HTTP on 80 for the mesh, HTTPS on 443 where it really serves.
        {"apiVersion": networking, "kind": "ServiceEntry", "metadata": {"name": "external", "namespace": "shop"},
         "spec": {"hosts": [EXTERNAL_HOST], "addresses": [EXTERNAL_VIP], "location": "MESH_EXTERNAL",
                  "resolution": "STATIC", "endpoints": [{"address": EXTERNAL_IP}],
                  "ports": [{"number": 80, "name": "http", "protocol": "HTTP"},
                            {"number": 443, "name": "https", "protocol": "HTTPS"}]}},
        # The egress gateway's Service (its pods run as istio-system/egress).
        {"apiVersion": networking, "kind": "ServiceEntry", "metadata": {"name": "egressgateway", "namespace": "istio-system"},
         "spec": {"hosts": [GATEWAY_HOST], "location": "MESH_INTERNAL", "resolution": "STATIC",
                  "endpoints": [{"address": GATEWAY_IP, "serviceAccount": "egress", "labels": {"istio": "egressgateway"}}],
                  "ports": [{"number": 80, "name": "http2", "protocol": "HTTP2"}]}},
        {"apiVersion": networking, "kind": "Gateway", "metadata": {"name": "istio-egressgateway", "namespace": "shop"},
         "spec": {"selector": {"istio": "egressgateway"}, "servers": [
             {"port": {"number": 80, "name": "https-port-for-tls-origination", "protocol": "HTTPS"},
              "hosts": [EXTERNAL_HOST], "tls": {"mode": "ISTIO_MUTUAL"}}]}},
        {"apiVersion": networking, "kind": "DestinationRule", "metadata": {"name": "egressgateway-for-external", "namespace": "shop"},
         "spec": {"host": GATEWAY_HOST, "subsets": [{"name": "external", "trafficPolicy": {
             "loadBalancer": {"simple": "ROUND_ROBIN"},
             "portLevelSettings": [{"port": {"number": 80}, "tls": {"mode": "ISTIO_MUTUAL", "sni": EXTERNAL_HOST}}]}}]}},
        {"apiVersion": networking, "kind": "VirtualService", "metadata": {"name": "direct-external-through-egress-gateway",
                                                                          "namespace": "shop"},
         "spec": {"hosts": [EXTERNAL_HOST], "gateways": ["istio-egressgateway", "mesh"], "http": [
             {"match": [{"gateways": ["mesh"], "port": 80}],
              "route": [{"destination": {"host": GATEWAY_HOST, "subset": "external", "port": {"number": 80}}}]},
             {"match": [{"gateways": ["istio-egressgateway"], "port": 80}],
              "route": [{"destination": {"host": EXTERNAL_HOST, "port": {"number": 443}}}]}]}},
        {"apiVersion": networking, "kind": "DestinationRule", "metadata": {"name": "originate-tls", "namespace": "shop"},
         "spec": {"host": EXTERNAL_HOST, "trafficPolicy": {"portLevelSettings": [
             {"port": {"number": 443}, "tls": {"mode": "SIMPLE", "caCertificates": str(ca)}}]}}},
    ]


@dataclass
class Egress:
    sidecar: Envoy
    gateway: Envoy
    run: Callable[..., Any]


@pytest.fixture(scope="module")
def egress(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Egress]:
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (Debian's package) for the capture rules")
    workdir = tmp_path_factory.mktemp("egress")
    config = workdir / "mesh"
    config.mkdir()
    ca, cert, key = server_credential(EXTERNAL_HOST)
    for name, pem in (("ca.pem", ca), ("cert.pem", cert), ("key.pem", key)):
        (workdir / name).write_bytes(pem)
    (config / "objects.yaml").write_text(yaml.safe_dump_all(_objects(workdir / "ca.pem")))
    istiod = Istiod(workdir, "--config-dir", str(config), "--poll-interval", "100ms")
    try:
        with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as sidecar, \
                captured_pod(istiod, sidecar) as run:
            assert run("ip", "addr", "add", f"{EXTERNAL_VIP}/32", "dev", "lo").returncode == 0
            external = Process(sidecar.netns(sys.executable, "tests/tls_echo.py", EXTERNAL_IP, "443",
                                             str(workdir / "cert.pem"), str(workdir / "key.pem"), "external"),
                               name="external")
            try:
                with sidecar_envoy(istiod.xds_address, "egressgateway-1", "istio-system", GATEWAY_IP,
                                   service_account="egress", metadata={"LABELS": {"istio": "egressgateway"}},
                                   router=True, inside=sidecar) as gateway:
                    wait_until(lambda: gateway.get("/ready")[0] == 200, 20, "the gateway's listeners warm")
                    yield Egress(sidecar, gateway, run)
            finally:
                external.stop()
    finally:
        istiod.stop()


def _stat(envoy: Envoy, name: str) -> int:
    text = envoy.get(f"/stats?filter=^{name.replace('|', '[|]')}$")[1].strip()
    return int(text.rsplit(" ", 1)[-1]) if text else 0


def test_a_call_to_an_external_host_leaves_through_the_egress_gateway(egress: Egress) -> None:
    def call() -> str:
        done = egress.run("curl", "-s", "--max-time", "5", "-H", f"Host: {EXTERNAL_HOST}", f"http://{EXTERNAL_VIP}/egress")
        return done.stdout if done.returncode == 0 and done.stdout.startswith("{") else ""

    body = wait_until(call, 20, "the call through the egress gateway")
    print("sidecar -> egress gateway (ISTIO_MUTUAL) -> external (TLS origination):", body)
    assert json.loads(body) == {"name": "external", "path": "/egress"}
    # Both hops are the ones the config names: the sidecar's subset cluster to the gateway, the
    # gateway's cluster to the external host's 443.
    to_gateway = f"cluster.outbound|80|external|{GATEWAY_HOST}.upstream_cx_total"
    to_external = f"cluster.outbound|443||{EXTERNAL_HOST}.upstream_cx_total"
    print("sidecar:", to_gateway, _stat(egress.sidecar, to_gateway), "gateway:", to_external,
          _stat(egress.gateway, to_external))
    assert _stat(egress.sidecar, to_gateway) >= 1 and _stat(egress.gateway, to_external) >= 1
    # The hop to the gateway is mTLS with the gateway's identity, the hop out TLS to the external
    # host, verified with the DestinationRule's CA.
    clusters = {c["cluster"]["name"]: c["cluster"] for c in egress.sidecar.config_dump()["ClustersConfigDump"]
                ["dynamic_active_clusters"]}
    socket = clusters[f"outbound|80|external|{GATEWAY_HOST}"]["transport_socket"]["typed_config"]
    assert socket["sni"] == EXTERNAL_HOST
    assert GATEWAY_ID in json.dumps(socket["common_tls_context"])
    assert _stat(egress.gateway, f"cluster.outbound|443||{EXTERNAL_HOST}.ssl.handshake") >= 1


def test_a_direct_call_from_the_gateway_listener_without_mtls_is_refused(egress: Egress) -> None:
    """The gateway's server is ISTIO_MUTUAL: plain HTTP, or TLS without a mesh certificate, gets nothing."""
    plain = egress.run("curl", "-s", "--max-time", "5", "-o", "/dev/null", "-w", "%{http_code}",
                       "-H", f"Host: {EXTERNAL_HOST}", f"http://{GATEWAY_IP}:80/")
    assert plain.stdout in ("000", "") and plain.returncode != 0
    tls = egress.run("curl", "-sk", "--max-time", "5", "-o", "/dev/null", "-w", "%{http_code}",
                     "--resolve", f"{EXTERNAL_HOST}:80:{GATEWAY_IP}", f"https://{EXTERNAL_HOST}:80/")
    assert tls.stdout in ("000", "") and tls.returncode != 0

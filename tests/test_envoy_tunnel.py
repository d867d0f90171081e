"""DestinationRule trafficPolicy.tunnel with a real Envoy 1.40: an egress gateway (the set-up of
tests/test_envoy_gateway.py), then a captured sidecar, sends TCP connections to a database outside
the mesh through an HTTP forward proxy (tests/connect_proxy.py): the proxy is the host the route
names (a ServiceEntry), the DestinationRule's tunnel tells Envoy to CONNECT (or POST) to
targetHost:targetPort, and the proxy opens that connection to the database (a TCP echo)."""

from __future__ import annotations

import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from string import Template
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.envoy_peer import Envoy
from tests.peers import Istiod, Process, free_port, wait_until
from tests.pods import wait_serving
from tests.test_envoy_gateway import BIND, NAMESPACE, Gateway, gateway_envoy, mesh  # noqa: F401 (fixture)
from tests.test_envoy_sidecar import _dynamic
from tests.test_envoy_tcp_egress import connect, pod

PROXY_IP, DATABASE_IP = "127.0.0.73", "127.0.0.74"
TARGET = "db.corp.test:5432"


def _rule(protocol: str) -> dict[str, Any]:
    return {"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
            "metadata": {"name": "corp-proxy", "namespace": "shop"},
            "spec": {"host": "proxy.corp.test",
                     "trafficPolicy": {"tunnel": {"protocol": protocol, "targetHost": "db.corp.test", "targetPort": 5432}}}}


def _objects(proxy_port: int, tcp_port: int) -> list[dict[str, Any]]:
    return [
        {"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry", "metadata": {"name": "corp-proxy", "namespace": "shop"},
         "spec": {"hosts": ["proxy.corp.test"], "location": "MESH_EXTERNAL", "resolution": "STATIC",
                  "ports": [{"number": 3128, "name": "tcp-proxy", "protocol": "TCP", "targetPort": proxy_port}],
                  "endpoints": [{"address": PROXY_IP}]}},
        {"apiVersion": "networking.istio.io/v1", "kind": "Gateway", "metadata": {"name": "egress", "namespace": NAMESPACE},
         "spec": {"selector": {"istio": "ingressgateway"}, "servers": [
             {"port": {"number": tcp_port, "name": "tcp-db", "protocol": "TCP"}, "bind": BIND, "hosts": ["shop/*"]}]}},
        {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": "db-egress", "namespace": "shop"},
         "spec": {"hosts": ["db.corp.test"], "gateways": [f"{NAMESPACE}/egress"],
                  "tcp": [{"match": [{"port": tcp_port}],
                           "route": [{"destination": {"host": "proxy.corp.test", "port": {"number": 3128}}}]}]}},
    ]


def requests(proxy: Process, count: int) -> list[dict[str, Any]]:
    """The next `count` requests the proxy printed (a tunnel's end, a reset, may print an error)."""
    found: list[dict[str, Any]] = []
    while len(found) < count:
        line = proxy.next_json(5)
        if "method" in line:
            found.append(line)
    return found


class Tunnel:
    def __init__(self, gateway: Gateway, proxy: Process, tcp_port: int) -> None:
        self.gateway, self.proxy, self.tcp_port = gateway, proxy, tcp_port

    def call(self, line: bytes) -> bytes:
        """A line to the gateway's TCP server and the line the database answered."""
        with socket.create_connection((BIND, self.tcp_port), timeout=5) as connection:
            connection.sendall(line)
            return connection.makefile("rb").readline()

    def tunnelling_config(self) -> dict[str, Any]:
        assert self.gateway.envoy is not None
        listener = _dynamic(self.gateway.envoy.config_dump(), "listeners").get(f"{BIND}_{self.tcp_port}")
        assert listener is not None
        return dict(listener["filter_chains"][0]["filters"][0]["typed_config"].get("tunneling_config", {}))


@pytest.fixture
def tunnel(mesh: Gateway, mesh_dir: Path, processes: list[Process]) -> Iterator[Tunnel]:  # noqa: F811 (the fixture)
    proxy_port, database_port, tcp_port = free_port(PROXY_IP), free_port(DATABASE_IP), free_port(BIND)
    database = Process([sys.executable, "-m", "istiod.demo.apps", "tcp-echo", "--address",
                        f"{DATABASE_IP}:{database_port}", "--name", "db"], name="db")
    proxy = Process([sys.executable, "tests/connect_proxy.py", PROXY_IP, str(proxy_port),
                     f"{TARGET}={DATABASE_IP}:{database_port}"], name="corp-proxy")
    processes += [database, proxy]
    wait_serving(database)
    wait_serving(proxy)
    (mesh_dir / "egress.yaml").write_text(yaml.safe_dump_all([*_objects(proxy_port, tcp_port), _rule("CONNECT")]))
    with gateway_envoy(mesh) as started:
        yield Tunnel(started, proxy, tcp_port)


def test_tcp_through_the_gateway_is_tunnelled_by_connect_then_post(tunnel: Tunnel, mesh_dir: Path) -> None:
    config = wait_until(lambda: tunnel.tunnelling_config(), 15, "the tunnel in the gateway's listener")
    print("the gateway's tcp_proxy tunneling_config:", config)
    assert config == {"hostname": TARGET}
    answer = tunnel.call(b"select 1\n")
    (seen,) = requests(tunnel.proxy, 1)
    print(f"through CONNECT: the database answered {answer!r}; the proxy saw {seen}")
    assert answer == b"db: select 1\n"
    assert (seen["method"], seen["target"]) == ("CONNECT", TARGET)

    (mesh_dir / "rule.yaml").write_text(yaml.safe_dump(_rule("POST")))
    (mesh_dir / "egress.yaml").write_text((mesh_dir / "egress.yaml").read_text().rsplit("---", 1)[0])
    config = wait_until(lambda: (c := tunnel.tunnelling_config()).get("use_post") and c, 15, "POST in the gateway's listener")
    answer = tunnel.call(b"select 2\n")
    (seen,) = requests(tunnel.proxy, 1)
    print(f"through POST: the database answered {answer!r}; the proxy saw {seen}")
    assert answer == b"db: select 2\n"
    assert (seen["method"], seen["path"], seen["target"]) == ("POST", "/", TARGET)

    # Without the rule: Envoy sends the client's bytes to the proxy as they are; it refuses them.
    (mesh_dir / "rule.yaml").unlink()
    wait_until(lambda: not tunnel.tunnelling_config(), 15, "no tunnel in the gateway's listener")
    assert tunnel.call(b"select 3\n") == b"HTTP/1.1 400 Bad Request\r\n"
    assert requests(tunnel.proxy, 1)[0] == {"method": "", "raw": "select 3"}


SIDECAR_TUNNEL = """
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: corp-proxy, namespace: shop}
spec:
  hosts: [proxy.corp.test]
  location: MESH_EXTERNAL
  resolution: STATIC
  ports: [{number: 3128, name: tcp-proxy, protocol: TCP}]
  endpoints: [{address: 127.0.0.45}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: ext-through-proxy, namespace: shop}
spec:
  hosts: [tcp.external.test]
  tcp: [{route: [{destination: {host: proxy.corp.test, port: {number: 3128}, subset: $subset}}]}]
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: corp-proxy, namespace: shop}
spec:
  host: proxy.corp.test
  trafficPolicy: {tunnel: {targetHost: db.corp.test, targetPort: 5432}}
  subsets:
  - name: post
    trafficPolicy: {tunnel: {protocol: POST, targetHost: db.corp.test, targetPort: 5432}}
  - name: direct
    trafficPolicy: {loadBalancer: {simple: RANDOM}}
"""


@pytest.mark.skipif(shutil.which("iptables") is None, reason="needs iptables (Debian's package) for the capture rules")
def test_a_sidecars_tcp_route_tunnels_as_its_destinations_subset_says(
        mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    """web-1's sidecar (captured, tests/test_envoy_tcp_egress.py's pod): TCP to tcp.external.test's
    VIP is routed to the proxy host; the rule's tunnel CONNECTs, subset `post` POSTs, and subset
    `direct`, which sets no tunnel, sends the bytes as they are."""
    with pod(mesh_dir, start_istiod, extra=Template(SIDECAR_TUNNEL).substitute(subset="''")) as (envoy, run, _):
        proxy = Process(envoy.netns(sys.executable, "tests/connect_proxy.py", "127.0.0.45", "3128",
                                    f"{TARGET}=127.0.0.32:5432"), name="corp-proxy")
        try:
            wait_serving(proxy)
            for subset, method in (("", "CONNECT"), ("post", "POST"), ("direct", "")):
                (mesh_dir / "extra.yaml").write_text(Template(SIDECAR_TUNNEL).substitute(subset=subset or "''"))
                wait_until(lambda: tunneled(envoy) == (f"outbound|3128|{subset}|proxy.corp.test", bool(method)), 15,
                           f"the route to subset {subset!r} in Envoy")
                replies = connect(run, "10.96.5.1:7000", 2)
                seen = requests(proxy, len(replies))
                print(f"subset {subset!r}: replies {replies}; the proxy saw {[(s['method'], s.get('target')) for s in seen]}")
                assert [s["method"] for s in seen] == [method] * 2
                if not method:  # the client's own bytes, which the proxy refuses
                    assert replies == ["HTTP/1.1 400 Bad Request"] * 2 and {s["raw"] for s in seen} == {"hi"}
                else:
                    assert replies == ["db-1: hi"] * 2 and {s["target"] for s in seen} == {TARGET}
        finally:
            proxy.stop()


def tunneled(envoy: Envoy) -> tuple[str, bool] | None:
    """(cluster, whether it tunnels) of the tcp_proxy on tcp.external.test's VIP listener."""
    found = _dynamic(envoy.config_dump(), "listeners").get("10.96.5.1_7000")
    if found is None:
        return None
    config = found["filter_chains"][0]["filters"][0]["typed_config"]
    return config.get("cluster", ""), "tunneling_config" in config

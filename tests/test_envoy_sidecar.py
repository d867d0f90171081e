"""The sidecar generator with a real Envoy 1.40 on istiod's plaintext xDS port: Envoy ACKs every
type, and its own /config_dump holds Istio's listeners, clusters, endpoints and routes."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from envoy.config.core.v3 import address_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from google.protobuf import wrappers_pb2

from istiod.ca.settings import CaSettings
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.server import Discovery
from istiod.settings import Address, Settings
from istiod.xds import gen, types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.filters import tcp_proxy
from tests.conftest import DATA, synced
from tests.envoy_peer import Envoy, node_id, sidecar_envoy
from tests.peers import ROOT, Istiod, Process, eventually, wait_until
from tests.test_cli import istiod_cli, table

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
        # Istio's domains: no ports (Envoy ignores the Host header's), the FQDN also absolute.
        assert hosts[f"{WEB}:80"]["domains"] == [WEB, f"{WEB}.", "web", "web.shop.svc", "web.shop", "10.96.0.10"]
        assert routes["80"]["ignore_port_in_host_matching"]
        assert hosts["allow_any"]["routes"][0]["route"]["cluster"] == "PassthroughCluster"
        assert listeners["virtualOutbound"]["filter_chains"][-1]["filters"][0]["typed_config"]["cluster"] == \
            "PassthroughCluster"
        assert listeners["0.0.0.0_80"]["default_filter_chain"]["filters"][0]["typed_config"]["cluster"] == \
            "PassthroughCluster"
        print("Envoy printed:\n" + _notable(envoy))

        # The CLI reads what istiod sent, as for proxyless clients.
        assert table(istiod_cli(istiod, "proxy-status").stdout)["web-1.shop"][2:6] == ["SYNCED"] * 4
        rows = _rows(istiod_cli(istiod, "proxy-config", "listeners", "web-1.shop").stdout)
        assert ["virtualOutbound", "OUTBOUND", "ALL", "Cluster: PassthroughCluster"] in rows
        assert ["0.0.0.0_80", "OUTBOUND", "Trans: raw_buffer; App: http/1.1,h2c", "Route: 80"] in rows
        assert ["0.0.0.0_80", "OUTBOUND", "ALL (default)", "Cluster: PassthroughCluster"] in rows
        assert ["virtualInbound", "INBOUND", "Trans: raw_buffer; App: http/1.1,h2c",
                "Inline Route: InboundPassthroughCluster"] in rows
        assert ["virtualInbound", "INBOUND", "Trans: tls", "Cluster: InboundPassthroughCluster"] in rows
        assert ["10.96.0.11_5432", "OUTBOUND", "ALL", "Cluster: outbound|5432||db.shop.svc.cluster.local"] in rows
        assert ["virtualInbound", "INBOUND", "Port: 8080; Trans: raw_buffer", "Inline Route: inbound|8080||"] in rows
        clusters_table = table(istiod_cli(istiod, "proxy-config", "clusters", "web-1.shop").stdout)
        assert clusters_table[WEB] == [WEB, "80", "-", "OUTBOUND", "EDS", "LEAST_REQUEST"]
        routes_rows = _rows(istiod_cli(istiod, "proxy-config", "routes", "web-1.shop").stdout)
        assert ["80", f"{WEB}:80", f"{WEB} +5 more", "/*", f"outbound|80||{WEB}"] in routes_rows
        assert ["80", "allow_any", "*", "/*", "PassthroughCluster"] in routes_rows


def _rows(output: str) -> list[list[str]]:
    """Every row of a CLI table, split on its runs of three or more spaces."""
    return [[cell.strip() for cell in line.split("   ") if cell.strip()] for line in output.splitlines()]


def _notable(envoy: Envoy) -> str:
    """What Envoy said about the config it was sent (not its start-up inventory)."""
    words = ("cds:", "lds:", "warning", "error", "rejected", "initialized")
    return "".join(line for line in envoy.log().splitlines(True) if any(w in line for w in words))


CART = """
apiVersion: v1
kind: Service
metadata: {name: cart, namespace: shop}
spec:
  clusterIP: 10.96.0.13
  selector: {app: cart}
  ports: [{name: http, port: 9090}]
---
apiVersion: v1
kind: Pod
metadata: {name: cart-1, namespace: shop, labels: {app: cart}}
spec:
  containers: [{name: cart, ports: [{containerPort: 9090}]}]
status: {phase: Running, podIP: 127.0.0.34, conditions: [{type: Ready, status: "True"}]}
"""


XDS_FLAVORS = pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])


@XDS_FLAVORS
def test_service_changes_reach_envoy(mesh_dir: Path, start_istiod: Callable[..., Istiod], delta: bool) -> None:
    """Delta: a deleted service's listener and cluster leave Envoy through `removed_resources`."""
    _mesh(mesh_dir)
    istiod = start_istiod(mesh_dir)
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web",
                       delta=delta) as envoy:
        _acked(istiod, envoy)
        mesh = (mesh_dir / "mesh.yaml").read_text()
        # rpc turns from gRPC into HTTP/1.1: its cluster changes under the same name, its endpoints
        # do not. Envoy must not be left with it warming.
        (mesh_dir / "mesh.yaml").write_text(mesh.replace("appProtocol: grpc", "appProtocol: http"))

        def rpc_changed() -> bool:
            clusters = envoy.config_dump()["ClustersConfigDump"]
            rpc = _dynamic({"ClustersConfigDump": clusters}, "clusters")["outbound|7070||rpc.shop.svc.cluster.local"]
            return "typed_extension_protocol_options" not in rpc and not clusters.get("dynamic_warming_clusters")

        wait_until(rpc_changed, 15, "rpc's cluster changed and active in Envoy")
        (mesh_dir / "cart.yaml").write_text(CART)

        def changed() -> dict[str, Any] | None:
            dump = envoy.config_dump()
            listeners, endpoints, routes = (_dynamic(dump, kind) for kind in ("listeners", "endpoints", "routes"))
            done = ("0.0.0.0_9090" in listeners and "9090" in routes
                    and "outbound|9090||cart.shop.svc.cluster.local" in endpoints
                    and not dump["ClustersConfigDump"].get("dynamic_warming_clusters"))
            return dump if done else None

        dump = wait_until(changed, 15, "the new service in Envoy")
        cart = _dynamic(dump, "endpoints")["outbound|9090||cart.shop.svc.cluster.local"]["endpoints"][0]["lb_endpoints"]
        assert cart[0]["endpoint"]["address"]["socket_address"]["address"] == "127.0.0.34"
        assert "metadata" not in cart[0]  # no sidecar: plaintext
        _acked(istiod, envoy)

        documents = (mesh_dir / "mesh.yaml").read_text().split("---\n")
        (mesh_dir / "mesh.yaml").write_text("---\n".join(d for d in documents if "kind: Service\nmetadata: {name: db" not in d))

        def db_gone() -> bool:
            dump = envoy.config_dump()
            return ("10.96.0.11_5432" not in _dynamic(dump, "listeners")
                    and "outbound|5432||db.shop.svc.cluster.local" not in _dynamic(dump, "clusters"))

        wait_until(db_gone, 15, "the deleted service's listener and cluster to leave Envoy")
        _acked(istiod, envoy)
        print("Envoy printed:\n" + _notable(envoy))


def test_registry_only_blackholes_unknown_destinations(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    _mesh(mesh_dir)
    istiod = start_istiod(mesh_dir, "--outbound-traffic-policy", "REGISTRY_ONLY")
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as envoy:
        _acked(istiod, envoy)
        dump = envoy.config_dump()
        outbound = _dynamic(dump, "listeners")["virtualOutbound"]
        assert outbound["filter_chains"][-1]["filters"][0]["typed_config"]["cluster"] == "BlackHoleCluster"
        hosts = {h["name"]: h for h in _dynamic(dump, "routes")["80"]["virtual_hosts"]}
        assert "allow_any" not in hosts
        assert hosts["block_all"]["routes"][0]["direct_response"]["status"] == 502


def _duplicate_chains_listener() -> listener_pb2.Listener:
    """Valid protobuf that Envoy refuses: two filter chains with the same match."""
    chain = listener_components_pb2.FilterChain(filters=[tcp_proxy("BlackHoleCluster", "BlackHoleCluster")])
    return listener_pb2.Listener(
        name="duplicate-chains", bind_to_port=wrappers_pb2.BoolValue(value=False), filter_chains=[chain, chain],
        address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address="0.0.0.0", port_value=9999)),
    )


@XDS_FLAVORS
async def test_a_rejected_listener_shows_nacked_and_the_last_good_config_serves(
    mesh_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delta: bool
) -> None:
    """istiod in this process, so one generator can be made to add a listener Envoy rejects while
    the `cart` service exists: what every rejection by a real Envoy must look like. A delta NACK
    carries no version: istiod keeps the ACKed state as the last good one."""
    _mesh(mesh_dir)
    sidecar_listeners = gen.SIDECAR[types.LISTENER]

    def with_rejected(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
        resources = sidecar_listeners(snapshot, proxy, names, cache)
        if "cart.shop.svc.cluster.local" in snapshot.services:
            bad = _duplicate_chains_listener()
            resources.append(Resource(bad.name, types.LISTENER, bad.SerializeToString()))
        return resources

    monkeypatch.setitem(gen.SIDECAR, types.LISTENER, with_rejected)
    loopback = Address("127.0.0.1", 0)
    discovery = Discovery(Settings(
        config_dir=mesh_dir, grpc_addr=loopback, http_addr=loopback, monitoring_addr=loopback,
        secure_grpc_addr=loopback, webhook_addr=loopback, poll_interval=0.1, debounce_after=0.05,
        ca=CaSettings(state_dir=tmp_path / "state", extra_sans=("127.0.0.1",)),
    ))
    await discovery.start()
    ready = asyncio.create_task(discovery.wait_synced())
    debug = f"http://127.0.0.1:{discovery.ports['http']}"

    async def syncz() -> dict[str, Any]:
        def get() -> list[dict[str, Any]]:
            with urllib.request.urlopen(f"{debug}/debug/syncz", timeout=5) as reply:
                return json.loads(reply.read())
        return next((s for s in await asyncio.to_thread(get) if s["proxy"] == PROXY), {})

    async def cli(*args: str) -> str:
        # A generous bound: the CLI's start-up imports the Kubernetes client, which on a loaded machine
        # took more than 30 s (its output was complete, the process not yet gone).
        result = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "istiod", *args, "--istiod", debug],
                                         cwd=ROOT, capture_output=True, text=True, timeout=120)
        print(f"$ istiod {' '.join(args)}\n{result.stdout}{result.stderr}")
        return result.stdout

    def states(status: dict[str, Any]) -> list[bool]:
        return [bool(status.get(f"{t}_sent")) and status[f"{t}_sent"] == status.get(f"{t}_acked") for t in TYPES]

    try:
        await eventually(lambda: discovery.ads.ready, 10, "istiod ready")
        with sidecar_envoy(f"127.0.0.1:{discovery.ports['grpc']}", "web-1", "shop", "127.0.0.31",
                           service_account="web", delta=delta) as envoy:
            await eventually(lambda: _all_acked(syncz, states), 20, "Envoy to ACK every type")
            (mesh_dir / "cart.yaml").write_text(CART)
            # The routes of the new listeners may still be in flight when the NACK lands: wait for
            # the other types to settle, and fail if they never do.
            status = await eventually(lambda: _nacked(syncz, states), 15, "Envoy's NACK of the listeners")
            error = status["listener_nacked_error"]
            print(f"Envoy's NACK: {error}")
            assert "duplicate-chains" in error and "has the same matching rules" in error

            # Envoy kept its last good listeners and took the good ones of the rejected response (a new
            # one is active once its routes arrived: it may still be warming when the NACK is seen).
            good = {"virtualOutbound", "virtualInbound", "0.0.0.0_80", "0.0.0.0_9090"}

            async def active_listeners() -> set[str] | None:
                found = set(_dynamic(await asyncio.to_thread(envoy.config_dump), "listeners"))
                return found if found >= good else None

            listeners = await eventually(active_listeners, 15, f"Envoy's active listeners to include {sorted(good)}")
            assert "duplicate-chains" not in listeners

            # No push loop: the rejected response is not sent again while nothing changes.
            connection = next(c for c in discovery.ads.connections.values() if c.proxy.id == PROXY)
            nonce = connection.watched[types.LISTENER].nonce_sent
            await asyncio.sleep(1.5)
            assert connection.watched[types.LISTENER].nonce_sent == nonce

            table_row = _rows(await cli("proxy-status"))
            assert ["web-1.shop", "Kubernetes", "SYNCED", "NACKED", "SYNCED", "SYNCED"] == next(
                r for r in table_row if r[0] == "web-1.shop")[:6]
            diff = await cli("proxy-status", "web-1.shop")
            assert "Listeners Do Not Match (NACKED version " in diff and "has the same matching rules" in diff

            (mesh_dir / "cart.yaml").unlink()  # the bad listener goes: Envoy ACKs again
            await eventually(lambda: _all_acked(syncz, states), 15, "Envoy to ACK the listeners again")
            print("Envoy printed:\n" + _notable(envoy))
    finally:
        ready.cancel()
        await discovery.stop()


async def _all_acked(syncz: Callable[[], Any], states: Callable[[dict[str, Any]], list[bool]]) -> bool:
    return all(states(await syncz()))


async def _nacked(syncz: Callable[[], Any], states: Callable[[dict[str, Any]], list[bool]]) -> dict[str, Any] | None:
    """The status once the listeners are NACKed and every other type (CDS, EDS, RDS) is ACKed."""
    status = await syncz()
    return status if status.get("listener_nacked_error") and states(status) == [True, False, True, True] else None


# istio-init's rules, cut down to one pod whose Envoy also serves its own calls: the VIP range to
# 15001, the app's port to 15006, and what the inbound clusters send (from 127.0.0.6) let through.
CAPTURE = (
    ("-s", "127.0.0.6/32", "-j", "RETURN"),
    ("-p", "tcp", "-d", "10.96.0.0/16", "-j", "REDIRECT", "--to-ports", "15001"),
    ("-p", "tcp", "-d", "127.0.0.31", "--dport", "8080", "-j", "REDIRECT", "--to-ports", "15006"),
)


@pytest.mark.parametrize("mode", ["permissive", "strict", "auto-mtls-off"])
def test_traffic_through_the_sidecar_both_ways(mesh_dir: Path, start_istiod: Callable[..., Istiod], mode: str,
                                               tmp_path: Path) -> None:
    """web-1 calls its own service by VIP and name: out through virtualOutbound and the route, mTLS
    to itself (its pod has a sidecar), in through virtualInbound, to the app. A plaintext call
    straight to the app's port is served under PERMISSIVE and refused under STRICT. With meshConfig
    `enableAutoMtls: false` and no DestinationRule, the call by VIP goes in plaintext, as in Istio."""
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (Debian's package) for the capture rules")
    _mesh(mesh_dir)
    flags = {"strict": ["--mtls"], "permissive": []}.get(mode)
    if flags is None:
        (tmp_path / "mesh.yaml").write_text("enableAutoMtls: false\n")
        flags = ["--mesh-config", str(tmp_path / "mesh.yaml")]
    istiod = start_istiod(mesh_dir, *flags)
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as envoy, \
            captured_pod(istiod, envoy) as run:
        def call(url: str, host: str = "") -> subprocess.CompletedProcess[str]:
            return run("curl", "-s", "--max-time", "5", *(["-H", f"Host: {host}"] if host else []), url)

        # Until the app listens, Envoy answers 503 itself.
        reply = wait_until(lambda: (out := call("http://10.96.0.10/").stdout).startswith("{") and out, 10,
                           "the app's reply through the sidecar")
        seen = json.loads(reply)
        assert seen["host"] == "10.96.0.10"
        if mode == "auto-mtls-off":
            assert seen["xfcc"] is None  # plaintext: no client certificate reached the inbound side
        else:
            assert "URI=spiffe://cluster.local/ns/shop/sa/web" in seen["xfcc"]  # mTLS, the caller's identity
        assert json.loads(call("http://10.96.0.10/", host="web.shop:80").stdout)["host"] == "web.shop:80"
        plaintext = call("http://127.0.0.31:8080/")
        if mode == "strict":
            assert plaintext.returncode != 0 and not plaintext.stdout
        else:
            assert json.loads(plaintext.stdout)["xfcc"] is None
        stats = envoy.get("/stats?filter=(upstream_rq_200|ssl\\.handshake)$")[1]
        stats = "".join(line for line in stats.splitlines(True) if "|80||" in line or "|8080||" in line)
        print(f"Envoy's stats:\n{stats}")


@contextmanager
def captured_pod(istiod: Istiod, envoy: Envoy) -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    """web-1's network namespace with istio-init's capture rules and the app on 8080, once Envoy
    is synced and ready: yields `run`, a command in that namespace."""
    def run(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(envoy.netns(*command), capture_output=True, text=True, timeout=20)

    for command in (("ip", "link", "set", "lo", "up"), ("ip", "addr", "add", "10.96.0.10/32", "dev", "lo"),
                    *(("iptables", "-t", "nat", "-A", "OUTPUT", *rule) for rule in CAPTURE)):
        assert run(*command).returncode == 0, command
    app = Process(envoy.netns(sys.executable, "tests/http_echo.py", "127.0.0.31", "8080"), name="app")
    try:
        _acked(istiod, envoy)
        wait_until(lambda: envoy.get("/ready")[0] == 200, 10, "Envoy ready")
        yield run
    finally:
        app.stop()


WEB_POLICY = """
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: web, namespace: shop}
spec:
  host: web
  trafficPolicy:
    connectionPool: {http: {http2MaxRequests: 7}}
    outlierDetection: {consecutive5xxErrors: 5, interval: 10s, baseEjectionTime: 30s}
  subsets:
  - {name: v1, labels: {app: web}, trafficPolicy: {loadBalancer: {consistentHash: {httpHeaderName: x-user}}}}
  - {name: v2, labels: {app: web}, trafficPolicy: {tls: {mode: DISABLE}, loadBalancer: {simple: LEAST_REQUEST}}}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: web, namespace: shop}
spec:
  hosts: [web]
  http:
  - name: canary
    match: [{headers: {x-canary: {exact: "yes"}}, uri: {prefix: /api}}]
    route: [{destination: {host: web, subset: v2}}]
    fault: {abort: {httpStatus: 418, percentage: {value: 100}}, delay: {fixedDelay: 10ms, percentage: {value: 1}}}
    timeout: 3s
    retries: {attempts: 4, retryOn: "5xx,unavailable", perTryTimeout: 1s}
  - route:
    - {destination: {host: web, subset: v1}, weight: 90}
    - {destination: {host: web, subset: v2}, weight: 10}
"""


def test_envoy_acks_virtual_service_and_destination_rule(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    """The translation shared with proxyless gRPC, as Envoy takes it."""
    _mesh(mesh_dir)
    (mesh_dir / "policy.yaml").write_text(WEB_POLICY)
    istiod = start_istiod(mesh_dir)
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as envoy:
        _acked(istiod, envoy)
        dump = envoy.config_dump()
        clusters = _dynamic(dump, "clusters")
        v1, v2 = clusters[f"outbound|80|v1|{WEB}"], clusters[f"outbound|80|v2|{WEB}"]
        assert v1["lb_policy"] == "RING_HASH" and "transport_socket_matches" in v1
        assert v2["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"] == \
            "envoy.load_balancing_policies.least_request"
        assert v2["transport_socket"]["name"] == "envoy.transport_sockets.raw_buffer"
        assert v1["circuit_breakers"]["thresholds"][0]["max_requests"] == 7
        assert v1["outlier_detection"]["consecutive_5xx"] == 5
        assert {f"outbound|80|v1|{WEB}", f"outbound|80|v2|{WEB}"} <= set(_dynamic(dump, "endpoints"))
        web = next(h for h in _dynamic(dump, "routes")["80"]["virtual_hosts"] if h["name"] == f"{WEB}:80")
        canary, split = web["routes"]
        assert canary["route"]["cluster"] == f"outbound|80|v2|{WEB}"
        assert canary["route"]["retry_policy"]["num_retries"] == 4
        assert canary["typed_per_filter_config"]["envoy.filters.http.fault"]["abort"]["http_status"] == 418
        assert [c["weight"] for c in split["route"]["weighted_clusters"]["clusters"]] == [90, 10]
        listener = _dynamic(dump, "listeners")["0.0.0.0_80"]
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        assert [f["name"] for f in manager["http_filters"]] == [
            "envoy.filters.http.fault", "envoy.filters.http.cors", "envoy.filters.http.router"]
        print(f"Envoy ACKed routes {[r.get('name') for r in web['routes']]} and clusters "
              f"{sorted(n for n in clusters if '|80|' in n)}")


UNICODE_ROUTE = r"""
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: web, namespace: shop}
spec:
  hosts: [web]
  http:
  - match: [{uri: {regex: '/users/\pL+'}}]
    route: [{destination: {host: web}}]
"""


def test_envoy_acks_a_regex_over_its_default_program_size(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    """A Unicode class alone compiles to an RE2 program of 1200, past Envoy's default limit (100),
    which NACKs the whole route configuration; under the bootstrap's runtime limit, which
    validation holds regexes to, Envoy takes it."""
    _mesh(mesh_dir)
    (mesh_dir / "users.yaml").write_text(UNICODE_ROUTE)
    istiod = start_istiod(mesh_dir)
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as envoy:
        _acked(istiod, envoy)
        web = next(h for h in _dynamic(envoy.config_dump(), "routes")["80"]["virtual_hosts"] if h["name"] == f"{WEB}:80")
        assert web["routes"][0]["match"]["safe_regex"]["regex"] == r"/users/\pL+"
        status, runtime = envoy.get("/runtime")
        entries = {name: entry["final_value"] for name, entry in json.loads(runtime)["entries"].items()}
        assert status == 200 and entries == {"re2.max_program_size.error_level": "32768",
                                             "envoy.reloadable_features.http_reject_path_with_fragment": "false"}

"""TCP routes, Sidecar egress listeners and ServiceEntries with a real Envoy 1.40 behind istio-init's
capture: web-1's network namespace (made by `unshare`, so it has no name to collide) holds the
apps at their pod and ServiceEntry addresses, and every connection to a 10.96.x VIP goes through
Envoy's virtualOutbound."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from istiod.ca.pki import cert_pem, key_pem, new_key
from tests.conftest import DATA
from tests.envoy_peer import Envoy, sidecar_envoy
from tests.peers import Istiod, Process, wait_until
from tests.pki import ca_cert
from tests.test_cli import istiod_cli
from tests.pods import wait_serving
from tests.test_envoy_sidecar import _dynamic, _mesh, _notable, captured_pod
from tests.test_sidecar_egress_gen import SIDECAR_RESOURCE, db_route

DB = "db.shop.svc.cluster.local"
# The apps: pods db-1 and db-2 (Service db), and the ServiceEntries' hosts at their endpoints.
APPS = (("tcp-echo", "127.0.0.32:5432", "db-1"), ("tcp-echo", "127.0.0.35:5432", "db-2"),
        ("tcp-echo", "127.0.0.40:7000", "ext"), ("http-server", "127.0.0.1:8090", "echo-external"))
VIPS = ("10.96.0.11", "10.96.0.14", "10.96.5.1", "10.96.5.2", "10.96.7.7")
# Connects `count` times to host:port, sends a line, and prints every reply line: what the app
# answered, `closed` when Envoy closed (or reset) the connection without one (BlackHoleCluster).
CONNECT = """
import json, socket, sys
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
replies = []
for _ in range(count):
    try:
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(b"hi\\n")
            replies.append(sock.makefile().readline().strip() or "closed")
    except ConnectionResetError:
        replies.append("closed")
    except OSError as error:
        replies.append(type(error).__name__)
print(json.dumps(replies))
"""

# A TLS server that answers its name to whoever completes a handshake, and a client that prints
# who answered for a given SNI: Envoy routes the connection by the SNI without terminating TLS.
TLS_SERVER = """
import json, socket, ssl, sys
address, port, name, cert = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert)
server = socket.create_server((address, port))
print(json.dumps({"serving": f"{address}:{port}", "name": name}), flush=True)
while True:
    connection, _ = server.accept()
    try:
        with context.wrap_socket(connection, server_side=True) as tls:
            tls.sendall(name.encode() + b"\\n")
    except (OSError, ssl.SSLError):
        pass
"""
TLS_CLIENT = """
import socket, ssl, sys
context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as sock:
    with context.wrap_socket(sock, server_hostname=sys.argv[3] or None) as tls:
        print(tls.makefile().readline().strip())
"""

pytestmark = pytest.mark.skipif(shutil.which("iptables") is None,
                                 reason="needs iptables (Debian's package) for the capture rules")


@contextmanager
def pod(mesh_dir: Path, start_istiod: Callable[..., Istiod], *flags: str,
        extra: str = "") -> Iterator[tuple[Envoy, Callable[..., Any], Istiod]]:
    """web-1 with its Envoy, capture and apps, on sidecar-mesh.yaml + tcp-egress.yaml + `extra`."""
    _mesh(mesh_dir)
    shutil.copy(DATA / "tcp-egress.yaml", mesh_dir / "tcp-egress.yaml")
    (mesh_dir / "extra.yaml").write_text(extra)
    istiod = start_istiod(mesh_dir, *flags)
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as envoy, \
            captured_pod(istiod, envoy) as run:
        # The VIPs the tests call (web's 10.96.0.10 is captured_pod's) and an address no one has:
        # routable, so that the capture rules see the connections.
        for vip in VIPS:
            assert run("ip", "addr", "add", f"{vip}/32", "dev", "lo").returncode == 0
        apps = []
        try:
            for kind, address, name in APPS:
                apps.append(Process(envoy.netns(sys.executable, "-m", "istiod.demo.apps", kind, "--address", address,
                                                "--name", name), name=name))
                wait_serving(apps[-1])
            yield envoy, run, istiod
            print("Envoy printed:\n" + _notable(envoy))
        finally:
            for app in apps:
                app.stop()


def connect(run: Callable[..., Any], address: str, count: int = 1) -> list[str]:
    host, _, port = address.rpartition(":")
    done = run(sys.executable, "-c", CONNECT, host, port, str(count))
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def listener(envoy: Envoy, name: str) -> dict[str, Any] | None:
    return _dynamic(envoy.config_dump(), "listeners").get(name)


def blackholed(envoy: Envoy) -> int:
    """Connections Envoy sent to BlackHoleCluster (which has no endpoints)."""
    stat = "cluster.BlackHoleCluster.upstream_cx_none_healthy"
    return int(dict(line.split(": ") for line in envoy.get(f"/stats?filter=^{stat}$")[1].splitlines()).get(stat, 0))


def proxy_config(found: dict[str, Any] | None) -> dict[str, Any]:
    assert found is not None
    return dict(found["filter_chains"][0]["filters"][0]["typed_config"])


def test_tcp_routes_to_a_subset_then_a_weighted_split(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    """40 connections over a 50/50 split: both destinations answer, except with probability
    2 * 0.5^40 < 2e-12; with the route to subset v2 alone, db-2 answers all 20."""
    to_v2 = db_route("[{match: [{port: 5432}], route: [{destination: {host: db, subset: v2}}]}]")
    with pod(mesh_dir, start_istiod, extra=to_v2) as (envoy, run, istiod):
        assert proxy_config(listener(envoy, "10.96.0.11_5432"))["cluster"] == f"outbound|5432|v2|{DB}"
        replies = Counter(connect(run, "10.96.0.11:5432", 20))
        print(f"20 connections to db's VIP, tcp route to subset v2: {dict(replies)}")
        assert replies == {"db-2: hi": 20}

        (mesh_dir / "extra.yaml").write_text(db_route(
            "[{route: [{destination: {host: db, subset: v2}, weight: 50},"
            " {destination: {host: tcp.external.test}, weight: 50}]}]"))
        split = wait_until(lambda: proxy_config(listener(envoy, "10.96.0.11_5432")).get("weighted_clusters"), 15,
                           "the weighted tcp route in Envoy")
        assert [(c["name"], c["weight"]) for c in split["clusters"]] == [
            (f"outbound|5432|v2|{DB}", 50), ("outbound|7000||tcp.external.test", 50)]
        replies = Counter(connect(run, "10.96.0.11:5432", 40))
        print(f"40 connections to db's VIP, 50/50 between db v2 and tcp.external.test: {dict(replies)}")
        assert set(replies) == {"db-2: hi", "ext: hi"}
        listeners = istiod_cli(istiod, "proxy-config", "listeners", "web-1.shop").stdout
        print(listeners)
        assert f"WeightedClusters: outbound|5432|v2|{DB} (50), outbound|7000||tcp.external.test (50)" in listeners


def test_sidecar_egress_listeners_and_outbound_policy(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    """The Sidecar resource's egress listeners: db on port 15432 through capture and on
    127.0.0.1:15433 bound by Envoy (captureMode NONE); db's own port is not seen, so under the
    Sidecar's REGISTRY_ONLY it is blackholed; web still works; rpc is gone from Envoy. The
    Sidecar resource arrives while Envoy runs."""
    with pod(mesh_dir, start_istiod) as (envoy, run, istiod):
        assert connect(run, "10.96.0.11:5432", 1)[0] in ("db-1: hi", "db-2: hi")
        (mesh_dir / "extra.yaml").write_text(SIDECAR_RESOURCE)
        wait_until(lambda: listener(envoy, "127.0.0.1_15433") and not listener(envoy, "10.96.0.11_5432"), 15,
                   "the Sidecar resource's listeners in Envoy")
        dump = envoy.config_dump()
        listeners, clusters = _dynamic(dump, "listeners"), _dynamic(dump, "clusters")
        print(f"Envoy's listeners: {sorted(listeners)}")
        assert {"10.96.0.11_15432", "127.0.0.1_15433", "0.0.0.0_80"} <= set(listeners)
        assert not {"10.96.0.11_5432", "0.0.0.0_7070"} & set(listeners)
        assert "outbound|7070||rpc.shop.svc.cluster.local" not in clusters
        assert listeners["virtualOutbound"]["filter_chains"][-1]["filters"][0]["typed_config"]["cluster"] == \
            "BlackHoleCluster"

        moved = Counter(connect(run, "10.96.0.11:15432", 10))
        bound = Counter(connect(run, "127.0.0.1:15433", 10))
        unseen = Counter(connect(run, "10.96.0.11:5432", 3))
        print(f"db by its egress port 15432: {dict(moved)}; by Envoy's own 127.0.0.1:15433: {dict(bound)}; "
              f"by its service port 5432 (not in the Sidecar): {dict(unseen)}")
        assert set(moved) <= {"db-1: hi", "db-2: hi"} and set(bound) <= {"db-1: hi", "db-2: hi"}
        assert unseen == {"closed": 3} and blackholed(envoy) == 3
        web = run("curl", "-s", "--max-time", "5", "http://10.96.0.10/")
        assert json.loads(web.stdout)["host"] == "10.96.0.10", web


def test_service_entries_reachable_and_the_rest_blackholed_under_registry_only(
        mesh_dir: Path, start_istiod: Callable[..., Istiod], tmp_path: Path) -> None:
    """MESH_EXTERNAL ServiceEntries: a TCP host at a static address, an HTTP host whose endpoint
    is the DNS name `localhost`, which Envoy resolves itself (STRICT_DNS), and a TLS host without
    an address, told by SNI."""
    with pod(mesh_dir, start_istiod, "--outbound-traffic-policy", "REGISTRY_ONLY") as (envoy, run, istiod):
        dns = _dynamic(envoy.config_dump(), "clusters")["outbound|8090||echo.external.test"]
        assert dns["type"] == "STRICT_DNS"
        tcp = connect(run, "10.96.5.1:7000", 3)
        unknown_tcp = connect(run, "10.96.7.7:7000", 3)

        def curl(host: str) -> dict[str, Any]:
            done = run("curl", "-s", "--max-time", "5", "-o", "/dev/stdout", "-w", "\n%{http_code}",
                       "-H", f"Host: {host}", "http://10.96.5.2:8090/")
            body, _, code = done.stdout.rpartition("\n")
            return {"status": int(code or 0), "body": body}

        external = curl("echo.external.test:8090")
        unknown_http = curl("unknown.test")
        print(f"tcp.external.test (10.96.5.1:7000): {tcp}; an unknown address 10.96.7.7:7000: {unknown_tcp}")
        print(f"echo.external.test:8090 -> {external['status']} {external['body']}; "
              f"Host unknown.test -> {unknown_http['status']} {unknown_http['body']!r}")
        assert tcp == ["ext: hi"] * 3 and unknown_tcp == ["closed"] * 3 and blackholed(envoy) == 3
        assert external["status"] == 200 and json.loads(external["body"])["name"] == "echo-external"
        assert unknown_http["status"] == 502
        # b.tls.test has no address: whatever IP the client resolved it to, its SNI picks it on
        # 0.0.0.0_443 (10.96.7.7 stands for an address DNS gave); another SNI is blackholed.
        with tls_servers(envoy, tmp_path) as hello:
            by_sni = {sni: hello("10.96.7.7:443", sni) for sni in ("b.tls.test", "unknown.test")}
        print(f"TLS to 10.96.7.7:443 by SNI: {by_sni}")
        assert by_sni["b.tls.test"] == "b.tls.test" and by_sni["unknown.test"] != "b.tls.test"
        assert blackholed(envoy) == 4
        counters = envoy.get("/stats?filter=(BlackHoleCluster|external.test).*(upstream_cx_total|cx_none_healthy|"
                             "upstream_rq_200)$")[1]
        print(f"Envoy's stats:\n{counters}")


@contextmanager
def tls_servers(envoy: Envoy, workdir: Path) -> Iterator[Callable[[str, str], str]]:
    """secure-1 and b.tls.test's endpoint as TLS servers in the pod; yields `hello(address, sni)`:
    who answered a TLS client that connected to `address` with that SNI."""
    key = new_key()
    (workdir / "server.pem").write_text(cert_pem(ca_cert("tls test server", key)) + key_pem(key).decode())
    servers = [Process(envoy.netns(sys.executable, "-c", TLS_SERVER, address, "443", name, str(workdir / "server.pem")),
                       name=f"tls-{name}") for address, name in (("127.0.0.36", "secure-1"), ("127.0.0.41", "b.tls.test"))]
    try:
        for server in servers:
            wait_serving(server)

        def hello(address: str, sni: str) -> str:
            host, _, port = address.rpartition(":")
            done = subprocess.run(envoy.netns(sys.executable, "-c", TLS_CLIENT, host, port, sni),
                                  capture_output=True, text=True, timeout=20)
            return done.stdout.strip() or done.stderr.strip().splitlines()[-1]

        yield hello
    finally:
        for server in servers:
            server.stop()


def test_tls_routes_by_sni(mesh_dir: Path, start_istiod: Callable[..., Istiod], tmp_path: Path) -> None:
    """TLS to secure's VIP: SNI b.tls.test goes to the ServiceEntry host (the `tls` route), any
    other SNI, or none, to secure-1; Envoy never terminates the TLS."""
    with pod(mesh_dir, start_istiod) as (envoy, run, istiod), tls_servers(envoy, tmp_path) as hello:
        answers = {sni or "(no SNI)": hello("10.96.0.14:443", sni)
                   for sni in ("b.tls.test", "secure.shop.svc.cluster.local", "")}
        print(f"TLS to 10.96.0.14:443, who answered per SNI: {answers}")
        assert answers == {"b.tls.test": "b.tls.test", "secure.shop.svc.cluster.local": "secure-1",
                           "(no SNI)": "secure-1"}
        rows = [line for line in istiod_cli(istiod, "proxy-config", "listeners", "web-1.shop").stdout.splitlines()
                if "10.96.0.14_443" in line]
        print("\n".join(rows))
        assert any("SNI: b.tls.test" in row and "Cluster: outbound|443||b.tls.test" in row for row in rows)


PASSTHROUGH = """
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: wild, namespace: shop}
spec:
  hosts: ["*.example.test"]
  ports: [{number: 8090, name: http, protocol: HTTP}, {number: 443, name: tls, protocol: TLS}]
  location: MESH_EXTERNAL
  resolution: NONE
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: range, namespace: shop}
spec:
  hosts: [range.example.net]
  addresses: [10.97.9.0/24]
  ports: [{number: 7100, name: tcp, protocol: TCP}]
  location: MESH_EXTERNAL
  resolution: NONE
---
# A tls route by SNI for the wildcard host: one name elsewhere, the rest to the host itself.
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: wild-tls, namespace: shop}
spec:
  hosts: ["*.example.test"]
  tls:
  - match: [{sniHosts: [moved.example.test], port: 443}]
    route: [{destination: {host: b.tls.test}}]
  - match: [{sniHosts: ["*.example.test"], port: 443}]
    route: [{destination: {host: "*.example.test"}}]
---
# A port of undeclared protocol: sniffed, its HTTP routed by the host's VirtualService.
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: sniffed, namespace: shop}
spec:
  hosts: ["*.sniff.test"]
  ports: [{number: 8091, name: web}]
  location: MESH_EXTERNAL
  resolution: NONE
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: sniffed, namespace: shop}
spec:
  hosts: ["*.sniff.test"]
  http:
  - headers: {response: {set: {x-sniffed: "yes"}}}
    route: [{destination: {host: "*.sniff.test"}}]
"""
# The callers run as this uid, whose connections to 10.97.0.0/16 alone are captured: Envoy (root
# here) reaches the original destination itself, as pilot-agent's uid 1337 exemption lets it.
CLIENT_UID = "1000"


def test_none_resolution_entries_pass_wildcard_hosts_and_cidrs_under_registry_only(
        mesh_dir: Path, start_istiod: Callable[..., Istiod], tmp_path: Path) -> None:
    """resolution NONE: Envoy sends to the address the client connected to (ORIGINAL_DST). HTTP
    with a Host of `*.example.test` (curl resolves api.example.test to 10.97.8.1) passes, another
    Host gets 502; TLS with an SNI under `*.example.test` reaches whoever has the address, Envoy
    never terminating it (a VirtualService `tls` route by SNI sends one name elsewhere); TCP into
    10.97.9.0/24 passes, the same port elsewhere is blackholed."""
    with pod(mesh_dir, start_istiod, "--outbound-traffic-policy", "REGISTRY_ONLY", extra=PASSTHROUGH) as \
            (envoy, run, istiod):
        for command in (("ip", "addr", "add", "10.97.8.1/32", "dev", "lo"),
                        ("ip", "addr", "add", "10.97.9.5/32", "dev", "lo"),
                        ("ip", "addr", "add", "10.97.7.7/32", "dev", "lo"),  # routable, served by no one
                        ("iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", "10.97.0.0/16", "-m", "owner",
                         "--uid-owner", CLIENT_UID, "-j", "REDIRECT", "--to-ports", "15001")):
            assert run(*command).returncode == 0, command
        key = new_key()
        (tmp_path / "api.pem").write_text(cert_pem(ca_cert("tls test server", key)) + key_pem(key).decode())
        apps = [Process(envoy.netns(sys.executable, "-m", "istiod.demo.apps", "http-server", "--address",
                                    "10.97.8.1:8090", "--name", "api"), name="api"),
                Process(envoy.netns(sys.executable, "-m", "istiod.demo.apps", "http-server", "--address",
                                    "10.97.8.1:8091", "--name", "sniffed"), name="sniffed"),
                Process(envoy.netns(sys.executable, "-m", "istiod.demo.apps", "tcp-echo", "--address",
                                    "10.97.9.5:7100", "--name", "ranged"), name="ranged"),
                Process(envoy.netns(sys.executable, "-c", TLS_SERVER, "10.97.8.1", "443", "api-tls",
                                    str(tmp_path / "api.pem")), name="api-tls")]

        def client(*command: str) -> subprocess.CompletedProcess[str]:
            return run("setpriv", f"--reuid={CLIENT_UID}", f"--regid={CLIENT_UID}", "--clear-groups", *command)

        try:
            for app in apps:
                wait_serving(app)
            clusters = _dynamic(envoy.config_dump(), "clusters")
            assert clusters["outbound|8090||*.example.test"]["type"] == "ORIGINAL_DST"

            def curl(host: str, port: int = 8090) -> tuple[int, str]:
                done = client("curl", "-s", "-i", "--max-time", "5", "-w", "\n%{http_code}",
                              "--resolve", f"{host}:{port}:10.97.8.1", f"http://{host}:{port}/")
                body, _, code = done.stdout.rpartition("\n")
                return int(code or 0), body

            declared, undeclared = curl("api.example.test"), curl("api.other.test")
            print(f"api.example.test:8090 -> {declared}; api.other.test:8090 -> {undeclared}")
            assert declared[0] == 200 and json.loads(declared[1].partition("\n\n")[2])["name"] == "api"
            assert undeclared[0] == 502
            # The sniffed port: HTTP found by the inspector, routed by the VirtualService (its
            # response header), a Host no entry declares refused as on an HTTP port.
            sniffed, stranger = curl("api.sniff.test", 8091), curl("api.other.test", 8091)
            print(f"api.sniff.test:8091 (sniffed) -> {sniffed[0]}; api.other.test:8091 -> {stranger[0]}")
            assert sniffed[0] == 200 and "x-sniffed: yes" in sniffed[1].lower()
            assert json.loads(sniffed[1].partition("\n\n")[2])["name"] == "sniffed"
            assert stranger[0] == 502

            def hello(sni: str) -> str:
                done = client("/usr/bin/python3", "-c", TLS_CLIENT, "10.97.8.1", "443", sni)
                return done.stdout.strip() or (done.stderr.strip().splitlines() or ["nothing"])[-1]

            with tls_servers(envoy, tmp_path):  # b.tls.test's endpoint 127.0.0.41 among them
                by_sni = {sni: hello(sni) for sni in ("secure.example.test", "moved.example.test", "secure.other.test")}
            print(f"TLS to 10.97.8.1:443 by SNI: {by_sni}")
            assert by_sni["secure.example.test"] == "api-tls" and by_sni["moved.example.test"] == "b.tls.test"
            assert by_sni["secure.other.test"] not in ("api-tls", "b.tls.test")

            def tcp(address: str, count: int) -> list[str]:
                host, _, port = address.rpartition(":")
                done = client("/usr/bin/python3", "-c", CONNECT, host, port, str(count))
                assert done.returncode == 0, done.stderr
                return list(json.loads(done.stdout))

            before = blackholed(envoy)
            ranged, outside = tcp("10.97.9.5:7100", 3), tcp("10.97.7.7:7100", 2)
            print(f"TCP 10.97.9.5:7100 (in 10.97.9.0/24): {ranged}; 10.97.7.7:7100: {outside}")
            assert ranged == ["ranged: hi"] * 3 and outside == ["closed"] * 2
            assert blackholed(envoy) == before + 2
            rows = istiod_cli(istiod, "proxy-config", "listeners", "web-1.shop").stdout.splitlines()
            print("\n".join(r for r in rows if "example" in r or "7100" in r))
            assert any("Addr: 10.97.9.0/24" in r and "outbound|7100||range.example.net" in r for r in rows)
        finally:
            for app in apps:
                app.stop()

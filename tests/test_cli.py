"""`istiod proxy-status` and `istiod proxy-config` against a running istiod with real peers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from istiod import __version__

from istiod.xds import types
from tests.ads_client import AdsClient
from tests.conftest import CLIENT_PROXY, ECHO_HOST, ECHO_PORT, Mesh, render
from tests.peers import ROOT, Istiod, Process, eventually, wait_until

CLUSTER = f"outbound|{ECHO_PORT}||{ECHO_HOST}"


def istiod_cli(istiod: Istiod, *args: str) -> subprocess.CompletedProcess[str]:
    # A generous bound: the CLI's start-up imports the Kubernetes client, which took up to 30 s on a
    # loaded 2-core machine.
    result = subprocess.run([sys.executable, "-m", "istiod", *args, "--istiod", istiod.url("monitoring")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    print(f"$ istiod {' '.join(args)}\n{result.stdout}{result.stderr}")  # shown with -s: sample output
    return result


def table(output: str) -> dict[str, list[str]]:
    """Rows of a table by their first cell, split on istioctl's runs of three or more spaces."""
    lines = output.splitlines()
    return {cells[0]: cells for cells in ([c.strip() for c in line.split("   ") if c.strip()] for line in lines)}


def test_proxy_status_of_synced_proxies(synced_mesh: Mesh) -> None:
    istiod = synced_mesh.istiod
    result = istiod_cli(istiod, "proxy-status")
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    address = istiod.url("monitoring").removeprefix("http://")
    assert rows["NAME"] == ["NAME", "CLUSTER", "CDS", "LDS", "EDS", "RDS", "ISTIOD", "VERSION"]
    assert rows["demo-client.echo-ns"] == ["demo-client.echo-ns", "Kubernetes", "SYNCED", "SYNCED", "SYNCED", "SYNCED",
                                           address, "-"]
    assert rows["echo-a.echo-ns"] == ["echo-a.echo-ns", "Kubernetes", "NOT SENT", "SYNCED", "NOT SENT", "NOT SENT",
                                      address, "-"]

    result = istiod_cli(istiod, "proxy-status", "demo-client.echo-ns")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"Proxy: {CLIENT_PROXY} (connection {CLIENT_PROXY}-")
    assert [line.split(" (")[0] for line in lines[1:]] == [
        "Clusters Match", "Listeners Match", "Endpoints Match", "Routes Match"]


def test_proxy_status_of_a_real_client_that_nacks(
    mesh_dir: Path, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process]
) -> None:
    # With mesh-wide mTLS the clusters name the certificate provider `default`; a client whose
    # bootstrap has no certificate providers (not made by `istiod agent`) really NACKs them.
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="odd-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="plain", namespace="odd-ns", port=7070))
    (mesh_dir / "pod.yaml").write_text(render("pod.yaml", pod="plain-1", app="plain", namespace="odd-ns",
                                              ip="127.0.0.81", port=7070))
    istiod = start_istiod(mesh_dir, "--mtls")
    client = start_demo("client", "xds:///plain.odd-ns.svc.cluster.local:7070", "--xds", istiod.xds_address,
                        "--count", "0", "--interval", "0.2", "--namespace", "odd-ns", name="client")
    line = wait_until(lambda: next((l for l in client.drain() if "certificate provider" in l.get("error", "")),
                                   None), 15, "the client to reject the cluster")
    assert line["code"] == "UNAVAILABLE"

    rows = table(istiod_cli(istiod, "proxy-status").stdout)
    assert rows["demo-client.odd-ns"][2:6] == ["NACKED", "SYNCED", "NOT SENT", "SYNCED"]

    result = istiod_cli(istiod, "proxy-status", "demo-client.odd-ns")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("Clusters Do Not Match (NACKED version ")
    assert 'unrecognized certificate provider instance name: default' in lines[1]
    assert lines[2].split() == ["+", "outbound|7070||plain.odd-ns.svc.cluster.local", "sent,", "not", "ACKed"]


async def test_proxy_status_of_a_client_that_nacks_clusters(
    synced_mesh: Mesh, ads_client: Callable[..., AdsClient]
) -> None:
    istiod = synced_mesh.istiod
    client = ads_client(istiod, "nacker", "echo-ns")
    await client.subscribe(types.LISTENER, [f"{ECHO_HOST}:{ECHO_PORT}"])
    await client.subscribe(types.CLUSTER, [CLUSTER], nack="cluster rejected: lb_policy unsupported")
    await eventually(lambda: "nacked_error" in str(istiod.get("/debug/syncz")[1]), 5, "the NACK to arrive")

    result = await asyncio.to_thread(istiod_cli, istiod, "proxy-status")
    assert table(result.stdout)["nacker.echo-ns"][2:6] == ["NACKED", "SYNCED", "NOT SENT", "NOT SENT"]
    result = await asyncio.to_thread(istiod_cli, istiod, "proxy-status", "nacker.echo-ns")
    lines = result.stdout.splitlines()
    assert lines[1].startswith("Clusters Do Not Match (NACKED version ")
    assert lines[1].endswith(": cluster rejected: lb_policy unsupported)")
    assert lines[2].split() == ["+", CLUSTER, "sent,", "not", "ACKed"]
    assert lines[3].startswith("Listeners Match (version ")


def test_proxy_config_tables_and_json(synced_mesh: Mesh) -> None:
    istiod = synced_mesh.istiod
    proxy = "demo-client.echo-ns"
    clusters = table(istiod_cli(istiod, "proxy-config", "clusters", proxy).stdout)
    assert clusters["SERVICE FQDN"] == ["SERVICE FQDN", "PORT", "SUBSET", "DIRECTION", "TYPE", "LB POLICY"]
    assert clusters[ECHO_HOST] == [ECHO_HOST, "7070", "-", "OUTBOUND", "EDS", "ROUND_ROBIN"]

    listeners = table(istiod_cli(istiod, "proxy-config", "listeners", proxy).stdout)
    assert listeners[f"{ECHO_HOST}:7070"] == [f"{ECHO_HOST}:7070", "OUTBOUND", "ALL", f"Route: {CLUSTER}"]
    inbound = table(istiod_cli(istiod, "proxy-config", "listeners", "echo-a.echo-ns").stdout)
    port = synced_mesh.server_port
    name = f"xds.istio.io/grpc/lds/inbound/127.0.0.21:{port}"
    assert inbound[name] == [name, "INBOUND", "ALL", f"Inline Route: inbound|{port}||"]

    routes = table(istiod_cli(istiod, "proxy-config", "routes", proxy).stdout)
    assert routes[CLUSTER] == [CLUSTER, f"{ECHO_HOST}:7070", f"{ECHO_HOST} +7 more", "/*", CLUSTER]  # and echo, echo:7070

    endpoints = table(istiod_cli(istiod, "proxy-config", "endpoints", proxy).stdout)
    assert endpoints[f"127.0.0.21:{port}"] == [f"127.0.0.21:{port}", "HEALTHY", "-", CLUSTER]

    raw = json.loads(istiod_cli(istiod, "proxy-config", "clusters", proxy, "-o", "json").stdout)
    assert [c["name"] for c in raw] == [CLUSTER]


def test_cli_errors_are_one_line(synced_mesh: Mesh) -> None:
    result = istiod_cli(synced_mesh.istiod, "proxy-config", "clusters", "nobody.nowhere")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == ("istiod proxy-config: /debug/config_dump: HTTP 404: "
                             "proxy 'nobody.nowhere' is not connected to this istiod\n")
    down = subprocess.run([sys.executable, "-m", "istiod", "proxy-status", "--istiod", "http://127.0.0.1:9"],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert down.returncode == 1 and down.stderr.startswith("istiod proxy-status: cannot reach istiod at ")


def test_istioctl_habits(synced_mesh: Mesh) -> None:
    istiod = synced_mesh.istiod
    proxy = "demo-client.echo-ns"
    assert istiod_cli(istiod, "ps").stdout == istiod_cli(istiod, "proxy-status").stdout
    clusters = istiod_cli(istiod, "proxy-config", "clusters", proxy).stdout
    for kind in ("cluster", "c"):
        assert istiod_cli(istiod, "pc", kind, proxy).stdout == clusters
    assert istiod_cli(istiod, "pc", "ep", proxy).stdout == istiod_cli(istiod, "proxy-config", "endpoints", proxy).stdout

    # Filters, as istioctl's: what matches stays, the rest goes (the header stays).
    assert list(table(istiod_cli(istiod, "pc", "cluster", proxy, "--fqdn", "echo.echo-ns", "--port", "7070").stdout)) == [
        "SERVICE FQDN", ECHO_HOST]
    assert list(table(istiod_cli(istiod, "pc", "cluster", proxy, "--port", "7071").stdout)) == ["SERVICE FQDN"]
    assert list(table(istiod_cli(istiod, "pc", "cluster", proxy, "--fqdn", "other").stdout)) == ["SERVICE FQDN"]
    port = synced_mesh.server_port
    assert list(table(istiod_cli(istiod, "pc", "ep", proxy, "--port", str(port)).stdout)) == [
        "ENDPOINT", f"127.0.0.21:{port}"]
    assert list(table(istiod_cli(istiod, "pc", "ep", proxy, "--port", "1").stdout)) == ["ENDPOINT"]
    assert list(table(istiod_cli(istiod, "pc", "listener", proxy, "--port", "7070").stdout)) == ["NAME", f"{ECHO_HOST}:7070"]
    assert len(table(istiod_cli(istiod, "pc", "route", proxy, "--name", "nothing").stdout)) == 1

    # -o json is protobuf JSON as istioctl prints it: camelCase names, no @type on the resource itself.
    printed = istiod_cli(istiod, "pc", "cluster", proxy, "-o", "json").stdout
    cluster = json.loads(printed)[0]
    assert printed.startswith("[\n    {\n")  # istioctl's four-space indent
    assert cluster["name"] == CLUSTER and cluster["type"] == "EDS" and "edsClusterConfig" in cluster
    assert "@type" not in cluster and not [key for key in cluster if "_" in key]
    assert yaml.safe_load(istiod_cli(istiod, "pc", "cluster", proxy, "-o", "yaml").stdout) == [cluster]

    assert istiod_cli(istiod, "version").stdout == f"client version: {__version__}\n"
    assert istiod_cli(istiod, "version", "--short").stdout == f"{__version__}\n"
    assert istiod_cli(istiod, "version", "--remote").stdout == (
        f"client version: {__version__}\ncontrol plane version: {__version__}\n")

    refused = istiod_cli(istiod, "pc", "secret", proxy)
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1
    assert refused.stderr.startswith("istiod proxy-config: argument KIND: invalid choice: 'secret'")
    wrong = istiod_cli(istiod, "pc", "listener", proxy, "--fqdn", "x")
    assert (wrong.returncode, wrong.stderr) == (
        2, "istiod proxy-config listeners: unknown flag --fqdn (see istiod proxy-config listeners --help)\n")

"""ProxyConfig: Istio's merge order (mesh defaultConfig, ProxyConfig objects, the pod's annotation), the
merged config injected into the pod (both layouts), and what the agent takes from PROXY_CONFIG."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from istiod.agent.proxy_config import ProxyConfigError, parse_proxy_config
from istiod.agent.settings import add_proxy_flags, proxy_settings_from_args
from istiod.agent.envoy_bootstrap import envoy_bootstrap
from istiod.agent.bootstrap import NodeInfo
from istiod.model.config.common import Meta
from istiod.model.config.proxy_config import ProxyConfig, effective_proxy_config, merge_proxy_config
from istiod.model.proxy import Proxy
from istiod.sources.convert import convert
from istiod.webhooks.injection import inject, parse_injector
from istiod.xds.gen import affected_types
from tests.peers import Istiod, wait_until
from tests.test_injection import admission, apply, configmap_data, injector as own_injector
from tests.test_webhook import post

ROOT_NS = "istio-system"


def pc(namespace: str, name: str, created: str, selector: dict[str, str] | None = None, **spec: Any) -> ProxyConfig:
    body = {"apiVersion": "networking.istio.io/v1beta1", "kind": "ProxyConfig",
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
            "spec": {**({"selector": {"matchLabels": selector}} if selector else {}), **spec}}
    value = convert(body)[1]
    assert isinstance(value, ProxyConfig)
    return value


CONFIGS = [
    pc(ROOT_NS, "mesh", "2026-01-01T00:00:00Z", concurrency=1, environmentVariables={"A": "root", "B": "root"}),
    pc(ROOT_NS, "mesh-newer", "2026-01-02T00:00:00Z", concurrency=9),  # not the oldest: no effect
    pc("app", "ns", "2026-01-01T00:00:00Z", environmentVariables={"B": "ns", "C": "ns"}),
    pc("app", "web", "2026-01-01T00:00:00Z", {"app": "web"}, concurrency=4, environmentVariables={"D": "web"}),
    pc("app", "web-newer", "2026-01-03T00:00:00Z", {"app": "web"}, concurrency=8),
    pc("other", "ns", "2026-01-01T00:00:00Z", concurrency=7),
]
DEFAULT = {"discoveryAddress": "istiod.istio-system.svc:15012", "concurrency": 2, "proxyMetadata": {"A": "mesh", "Z": "mesh"}}


def test_merge_order_is_istios() -> None:
    # Mesh default < root namespace < workload namespace < annotation < selecting ProxyConfig.
    web = effective_proxy_config(DEFAULT, CONFIGS, ROOT_NS, "app", {"app": "web"},
                                 {"concurrency": 6, "proxyMetadata": {"D": "annotation", "E": "annotation"}})
    assert web == {"discoveryAddress": "istiod.istio-system.svc:15012", "concurrency": 4,
                   "proxyMetadata": {"A": "root", "B": "ns", "C": "ns", "D": "web", "E": "annotation", "Z": "mesh"}}
    # Without a selecting object the annotation is last; other namespaces' objects never apply.
    db = effective_proxy_config(DEFAULT, CONFIGS, ROOT_NS, "app", {"app": "db"}, {"concurrency": 6})
    assert db["concurrency"] == 6 and db["proxyMetadata"]["B"] == "ns"
    # The root namespace's workloads get the root object once; its selecting objects are its own.
    assert effective_proxy_config(DEFAULT, CONFIGS, ROOT_NS, ROOT_NS, {})["concurrency"] == 1
    assert effective_proxy_config(DEFAULT, [], ROOT_NS, "app", {}) == DEFAULT


def test_merge_replaces_fields_and_merges_metadata_and_headers() -> None:
    base = {"tracing": {"zipkin": {"address": "z:9411"}, "sampling": 1}, "proxyMetadata": {"A": "1"},
            "proxyHeaders": {"server": {"disabled": True}, "requestId": {"disabled": True}}}
    over = {"tracing": {"sampling": 50}, "proxyMetadata": {"B": "2"}, "proxyHeaders": {"server": {"value": "x"}}}
    assert merge_proxy_config(base, over) == {
        "tracing": {"sampling": 50},  # a message replaces, as protobuf's JSON into a set field
        "proxyMetadata": {"A": "1", "B": "2"},
        "proxyHeaders": {"server": {"value": "x"}, "requestId": {"disabled": True}}}


def test_object_values() -> None:
    web = CONFIGS[3]
    assert web.meta == Meta("web", "app") and web.selector == (("app", "web"),)
    assert web.as_mesh() == {"concurrency": 4, "proxyMetadata": {"D": "web"}}
    image = pc("app", "img", "", image={"imageType": "distroless"})
    assert image.as_mesh() == {"image": {"imageType": "distroless"}}


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def web_pod(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "web-", "labels": {"app": "web"}, "annotations": annotations or {}},
            "spec": {"containers": [{"name": "web", "image": "web:1"}]}}


@pytest.mark.parametrize("layout", ["istiod", "istio"])
def test_injection_carries_the_merged_config(layout: str) -> None:
    """The ProxyConfig objects' concurrency and environmentVariables reach the injected istio-proxy:
    PROXY_CONFIG, and each variable as the container's own (as Istio's template renders proxyMetadata)."""
    values = {"meshConfig": {"defaultConfig": {"proxyMetadata": {"A": "mesh"}, "drainDuration": "10s"}}}
    base = own_injector(**values) if layout == "istiod" else parse_injector(
        "layout: istio\n", json.dumps(values), "test")
    with_objects = dataclasses.replace(base, proxy_configs=tuple(CONFIGS), root_namespace=ROOT_NS)
    original = web_pod({"proxy.istio.io/config": "terminationDrainDuration: 20s"})
    injected = apply(original, inject(original, with_objects, namespace="app"))  # the namespace from the request
    proxy = next(c for c in injected["spec"]["containers"] if c["name"] == "istio-proxy")
    env = env_of(proxy)
    config = json.loads(env["PROXY_CONFIG"])
    assert config["concurrency"] == 4 and config["drainDuration"] == "10s" and config["terminationDrainDuration"] == "20s"
    assert config["proxyMetadata"] == {"A": "root", "B": "ns", "C": "ns", "D": "web"}
    assert (env["A"], env["B"], env["C"], env["D"]) == ("root", "ns", "ns", "web")
    # No objects: the mesh's defaultConfig alone.
    plain = apply(web_pod(), inject(web_pod(), base, namespace="app"))
    proxy = next(c for c in plain["spec"]["containers"] if c["name"] == "istio-proxy")
    assert json.loads(env_of(proxy)["PROXY_CONFIG"])["proxyMetadata"] == {"A": "mesh"}


def proxy_settings(monkeypatch: pytest.MonkeyPatch, proxy_config: str, *flags: str) -> Any:
    monkeypatch.setenv("PROXY_CONFIG", proxy_config)
    for name in ("STATUS_PORT", "TERMINATION_DRAIN_DURATION_SECONDS", "ISTIO_META_TEAM"):
        monkeypatch.delenv(name, raising=False)
    parser = argparse.ArgumentParser()
    add_proxy_flags(parser)
    return proxy_settings_from_args(parser.parse_args(list(flags)))


def test_agent_applies_proxy_config_under_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    text = json.dumps({"concurrency": 3, "drainDuration": "12s", "terminationDrainDuration": "7s", "statusPort": 15120,
                       "proxyMetadata": {"ISTIO_META_TEAM": "blue", "OTHER": "x"},
                       "proxyStatsMatcher": {"inclusionPrefixes": ["http.inbound"]},
                       "tracing": {"sampling": 1}, "image": {"imageType": "debug"}})
    settings = proxy_settings(monkeypatch, text)
    assert (settings.concurrency, settings.envoy_drain_time, settings.drain_duration) == (3, 12.0, 7.0)
    assert settings.status == ("", 15120)
    assert ("ISTIO_META_TEAM", "blue") in settings.metadata
    assert settings.ignored == ("tracing",)  # named in a warning; image is injection's
    flagged = proxy_settings(monkeypatch, text, "--concurrency", "1", "--termination-drain-duration", "2s",
                             "--status-addr", ":15020")
    assert (flagged.concurrency, flagged.drain_duration, flagged.status) == (1, 2.0, ("", 15020))
    defaults = proxy_settings(monkeypatch, "")
    assert (defaults.concurrency, defaults.envoy_drain_time, defaults.drain_duration, defaults.status) == (
        2, 45.0, 5.0, ("", 15020))
    bootstrap = envoy_bootstrap(NodeInfo("10.0.0.1", "p", "ns", "sa", "Kubernetes"), {}, {}, ("", 15090),
                                settings.stats_matcher)
    patterns = bootstrap["stats_config"]["stats_matcher"]["inclusion_list"]["patterns"]
    assert {"prefix": "http.inbound"} in patterns and {"prefix": "cluster_manager"} in patterns
    assert "stats_config" not in envoy_bootstrap(NodeInfo("10.0.0.1", "p", "ns", "sa", "Kubernetes"), {}, {},
                                                 ("", 15090))


@pytest.mark.parametrize(("text", "message"), [
    ("{", "PROXY_CONFIG: not JSON or YAML"),
    ("[1]", "PROXY_CONFIG: not a ProxyConfig map"),
    ('{"concurrency": -1}', "PROXY_CONFIG concurrency: concurrency must be greater than or equal to 0"),
    ('{"concurrency": "2"}', "PROXY_CONFIG concurrency: '2' is not an integer"),
    ('{"drainDuration": "500us"}', "invalid drain duration: duration must be greater than 1ms"),
    ('{"drainDuration": "1500ms"}', "drain time only supports durations to seconds precision"),
    ('{"terminationDrainDuration": "5"}', "PROXY_CONFIG terminationDrainDuration: duration '5' must be a number"),
    ('{"statusPort": 70000}', "invalid status port: port number 70000 must be in the range 1..65535"),
    ('{"proxyStatsMatcher": {"inclusionPrefixes": "x"}}', "proxyStatsMatcher.inclusionPrefixes: a list of strings"),
    ('{"proxyStatsMatcher": {"exclusion": []}}', "PROXY_CONFIG proxyStatsMatcher: a map of inclusionPrefixes"),
])
def test_agent_refuses_a_bad_proxy_config_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(ProxyConfigError, match=message):
        parse_proxy_config(text)


def test_agent_with_a_bad_proxy_config_exits_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit, match="istiod agent proxy: PROXY_CONFIG concurrency"):
        proxy_settings(monkeypatch, '{"concurrency": -2}')



def test_istiod_injects_its_stores_proxy_configs(mesh_dir: Path, tmp_path: Path,
                                                 start_istiod: Callable[..., Istiod]) -> None:
    """istiod's /inject over HTTPS with its mesh config's defaultConfig and a ProxyConfig from its config
    source: the object's concurrency and environmentVariables land in the injected istio-proxy over the
    mesh's (the namespace from the AdmissionReview)."""
    (mesh_dir / "proxyconfig.yaml").write_text(yaml.safe_dump({
        "apiVersion": "networking.istio.io/v1beta1", "kind": "ProxyConfig",
        "metadata": {"name": "web", "namespace": "demo"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "concurrency": 5,
                 "environmentVariables": {"ISTIO_META_TEAM": "blue"}}}))
    injection = tmp_path / "inject"
    injection.mkdir()
    for key, text in configmap_data().items():
        (injection / key).write_text(text)
    mesh = tmp_path / "mesh.yaml"  # istiod's mesh config, whose defaultConfig Istio's injector reads
    mesh.write_text("defaultConfig:\n  drainDuration: 9s\n  proxyMetadata: {ISTIO_META_TEAM: red, ZONE: a}\n")
    istiod = start_istiod(mesh_dir, "--injection-dir", str(injection), "--mesh-config", str(mesh))
    wait_until(lambda: istiod.get("/ready")[0] == 200, 10, "istiod to read its config")
    status, answer = post(istiod, admission(web_pod(), namespace="demo"), "/inject")
    assert status == 200, answer
    patched = apply(web_pod(), json.loads(base64.b64decode(answer["response"]["patch"])))
    env = env_of(next(c for c in patched["spec"]["containers"] if c["name"] == "istio-proxy"))
    print("injected PROXY_CONFIG:", env["PROXY_CONFIG"])
    assert json.loads(env["PROXY_CONFIG"]) == {"concurrency": 5, "discoveryAddress": "istiod.istio-system.svc:15012",
                                               "drainDuration": "9s",
                                               "proxyMetadata": {"ISTIO_META_TEAM": "blue", "ZONE": "a"}}
    assert (env["ISTIO_META_TEAM"], env["ZONE"]) == ("blue", "a")
    other = apply(web_pod(), json.loads(base64.b64decode(post(istiod, admission(web_pod(), namespace="other"),
                                                             "/inject")[1]["response"]["patch"])))
    assert "concurrency" not in json.loads(env_of(other["spec"]["containers"][1])["PROXY_CONFIG"])


@pytest.mark.parametrize(("proxy_type", "generator"), [
    ("sidecar", "grpc"), ("sidecar", "sidecar"), ("router", "router"), ("waypoint", "waypoint"), ("ztunnel", "ztunnel")])
def test_a_proxy_config_change_pushes_nothing(proxy_type: str, generator: str) -> None:
    """No generator reads ProxyConfig objects: a change reaches pods at injection, not over xDS."""
    proxy = Proxy(f"{proxy_type}~10.0.0.1~a.demo~demo.svc.cluster.local", proxy_type, ("10.0.0.1",), "a", "demo",
                  "demo.svc.cluster.local", generator)
    assert affected_types(proxy, ["ProxyConfig"]) == frozenset()


def test_hold_application_puts_our_proxy_first_with_a_wait_hook() -> None:
    held = web_pod({"proxy.istio.io/config": "holdApplicationUntilProxyStarts: true"})
    injected = apply(held, inject(held, own_injector(), namespace="app"))
    proxy = injected["spec"]["containers"][0]
    assert [c["name"] for c in injected["spec"]["containers"]] == ["istio-proxy", "web"]
    assert proxy["lifecycle"] == {"postStart": {"exec": {"command": ["istiod", "agent", "wait"]}}}
    plain = apply(web_pod(), inject(web_pod(), own_injector(), namespace="app"))
    assert [c["name"] for c in plain["spec"]["containers"]] == ["web", "istio-proxy"]
    assert "lifecycle" not in plain["spec"]["containers"][1]


def test_agent_wait_returns_once_the_proxy_is_ready(tmp_path: Path) -> None:
    """`istiod agent wait` (pilot-agent wait's flags) polls readiness: 0 once it answers 200, 1 with
    pilot-agent's line when it never does."""
    ready = threading.Event()

    class Readiness(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if ready.is_set() else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Readiness)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/healthz/ready"
    try:
        command = [sys.executable, "-m", "istiod", "agent", "wait", "--url", url, "--periodMillis", "100"]
        failed = subprocess.run([*command, "--timeoutSeconds", "1"], capture_output=True, text=True, timeout=30)
        assert failed.returncode == 1
        assert "timeout waiting for Envoy proxy to become ready. Last error: HTTP status code 503" in failed.stderr
        waiting = subprocess.Popen([*command, "--timeoutSeconds", "20"], stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(0.5)
            assert waiting.poll() is None  # still waiting on a proxy that is not ready
            ready.set()
            assert waiting.wait(timeout=20) == 0
        finally:
            waiting.kill()
            waiting.wait()
        assert "Envoy is ready!" in (waiting.stderr.read() if waiting.stderr else "")
    finally:
        server.shutdown()
        server.server_close()

"""meshConfig accessLogFile / accessLogEncoding / accessLogFormat: the file access log istiod puts on
sidecars' and gateways' connection managers, TCP proxies and listeners; and a real Envoy sidecar
writing a line per request to the file, in Istio's format."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2

from istiod.model.mesh import MeshConfig
from istiod.model.proxy import proxy_from_node
from istiod.sources.meshconfig import MeshConfigError, parse_mesh_config
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import SIDECAR
from istiod.xds.gen.accesslog import TEXT_FORMAT
from tests.envoy_peer import sidecar_envoy
from tests.peers import Istiod, wait_until
from tests.test_envoy_sidecar import _mesh, captured_pod
from tests.test_sidecar_gen import SIDECAR_NODE, _snapshot


def _listeners(mesh: MeshConfig) -> dict[str, listener_pb2.Listener]:
    proxy = proxy_from_node(SIDECAR_NODE, {})
    return {r.name: listener_pb2.Listener.FromString(r.value)
            for r in SIDECAR[types.LISTENER](_snapshot(mesh), proxy, None, ResourceCache())}


def _file_log(config: object) -> file_pb2.FileAccessLog:
    log = file_pb2.FileAccessLog()
    getattr(config, "access_log")[0].typed_config.Unpack(log)
    return log


def test_every_connection_manager_tcp_proxy_and_listener_logs() -> None:
    mesh = parse_mesh_config("accessLogFile: /dev/stdout", MeshConfig(), "mesh")
    assert _listeners(MeshConfig())["0.0.0.0_80"].access_log == []  # off by default, as Istio
    listeners = _listeners(mesh)
    http = listeners["0.0.0.0_80"]
    manager = hcm_pb2.HttpConnectionManager()
    http.filter_chains[0].filters[-1].typed_config.Unpack(manager)
    log = _file_log(manager)
    assert log.path == "/dev/stdout" and log.log_format.text_format_source.inline_string == TEXT_FORMAT
    assert [f.name for f in http.access_log] == ["envoy.access_loggers.file"]
    assert list(http.access_log[0].filter.response_flag_filter.flags) == ["NR"]
    tcp = next(listener for name, listener in listeners.items() if name.endswith("_5432"))
    proxy = tcp_proxy_pb2.TcpProxy()
    tcp.filter_chains[0].filters[-1].typed_config.Unpack(proxy)
    assert _file_log(proxy).path == "/dev/stdout"


def test_json_and_custom_formats() -> None:
    mesh = parse_mesh_config('{accessLogFile: /var/log/a, accessLogEncoding: JSON, accessLogFormat: \'{"p": "%REQ_WITHOUT_QUERY(:PATH)%"}\'}',
                             MeshConfig(), "mesh")
    manager = hcm_pb2.HttpConnectionManager()
    _listeners(mesh)["0.0.0.0_80"].filter_chains[0].filters[-1].typed_config.Unpack(manager)
    log = _file_log(manager)
    assert dict(log.log_format.json_format) == {"p": "%REQ_WITHOUT_QUERY(:PATH)%"}
    assert [f.name for f in log.log_format.formatters] == ["envoy.formatter.req_without_query"]
    text = parse_mesh_config("{accessLogFile: /tmp/x, accessLogFormat: '%REQ(:PATH)%'}", MeshConfig(), "mesh")
    assert text.access_log is not None and text.access_log.format == "%REQ(:PATH)%"
    manager = hcm_pb2.HttpConnectionManager()
    _listeners(text)["0.0.0.0_80"].filter_chains[0].filters[-1].typed_config.Unpack(manager)
    assert _file_log(manager).log_format.text_format_source.inline_string == "%REQ(:PATH)%\n"  # newline added


def test_bad_settings(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(MeshConfigError, match="accessLogEncoding: 'XML' is not TEXT or JSON"):
        parse_mesh_config("{accessLogFile: /dev/stdout, accessLogEncoding: XML}", MeshConfig(), "mesh")
    caplog.set_level(logging.ERROR)
    mesh = parse_mesh_config("{accessLogFile: /dev/stdout, accessLogEncoding: JSON, accessLogFormat: 'nope'}",
                             MeshConfig(), "mesh")
    assert mesh.access_log is not None and mesh.access_log.format == ""  # Istio's default JSON format instead
    assert "accessLogFormat is not a JSON object" in caplog.text
    assert parse_mesh_config("accessLogFile: ''", MeshConfig(), "mesh").access_log is None


def test_a_real_sidecar_writes_a_line_per_request(mesh_dir: Path, start_istiod: Callable[..., Istiod],
                                                 tmp_path: Path) -> None:
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (Debian's package) for the capture rules")
    _mesh(mesh_dir)
    log = tmp_path / "access.log"
    (tmp_path / "mesh.yaml").write_text(f"accessLogFile: {log}\naccessLogEncoding: JSON\n")
    istiod = start_istiod(mesh_dir, "--mesh-config", str(tmp_path / "mesh.yaml"))
    with sidecar_envoy(istiod.xds_address, "web-1", "shop", "127.0.0.31", service_account="web") as envoy, \
            captured_pod(istiod, envoy) as run:  # web-1's app answers on 8080, behind Service web's 10.96.0.10

        attempts, answered_ids = iter(range(1000)), set()

        def answered() -> dict[str, object] | None:
            """The line of a call that got its 200 (Envoy writes the file a second or so later)."""
            request_id = f"access-log-{next(attempts)}"
            if run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5", "-H",
                   f"x-request-id: {request_id}", "http://10.96.0.10/hello").stdout == "200":
                answered_ids.add(request_id)
            lines = log.read_text().splitlines() if log.exists() else []
            return next((e for e in map(json.loads, lines) if e.get("request_id") in answered_ids
                         and e.get("upstream_cluster") == "outbound|80||web.shop.svc.cluster.local"), None)

        outbound = wait_until(answered, 20, "the sidecar's access log line of an answered call")
        print(f"access log: {outbound}")
        assert (outbound["method"], outbound["path"], outbound["response_code"]) == ("GET", "/hello", 200)

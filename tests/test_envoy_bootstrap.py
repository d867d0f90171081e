"""The Envoy bootstrap's node metadata and override merge, the SDS secrets, and `istiod agent proxy`'s
start-up mistakes (one line, exit 1, before any request to the CA)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from istiod.agent.admin import EnvoyAdmin
from istiod.agent.bootstrap import NodeInfo
from istiod.agent.envoy_bootstrap import envoy_bootstrap, merge_override, node_metadata
from tests.peers import ROOT, free_port

NODE = NodeInfo(ip="10.1.2.3", pod="web-1", namespace="app", service_account="web")


def test_metadata_from_the_pod_and_istio_meta_environment() -> None:
    metadata = node_metadata(NODE, {"ISTIO_META_CLUSTER_ID": "east", "ISTIO_METAJSON_LABELS": '{"app": "web"}',
                                    "ISTIO_META_MESH_ID": "mesh1", "HOME": "/root"})
    assert metadata == {"NAME": "web-1", "NAMESPACE": "app", "SERVICE_ACCOUNT": "web", "INSTANCE_IPS": "10.1.2.3",
                        "CLUSTER_ID": "east", "WORKLOAD_NAME": "web-1", "LABELS": {"app": "web"}, "MESH_ID": "mesh1",
                        "STATIC_LABELS": {"app": "web"}}
    # The pod's labels win over the static ones in LABELS, as pilot-agent's.
    labelled = dataclasses.replace(NODE, labels={"app": "pod", "version": "v1"})
    metadata = node_metadata(labelled, {"ISTIO_METAJSON_LABELS": '{"app": "web", "env": "prod"}'})
    assert metadata["LABELS"] == {"app": "pod", "version": "v1", "env": "prod"}
    assert metadata["STATIC_LABELS"] == {"app": "web", "env": "prod"}
    with pytest.raises(ValueError, match="^ISTIO_METAJSON_LABELS is not JSON: "):
        node_metadata(NODE, {"ISTIO_METAJSON_LABELS": "{app"})


def test_bootstrap_and_override() -> None:
    bootstrap = envoy_bootstrap(NODE, {"NAMESPACE": "app"}, EnvoyAdmin(("127.0.0.1", 15000)).bootstrap_address(),
                                ("", 15090))
    assert bootstrap["node"]["id"] == "sidecar~10.1.2.3~web-1.app~app.svc.cluster.local"
    assert bootstrap["admin"] == {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}}
    assert [c["name"] for c in bootstrap["static_resources"]["clusters"]] == ["xds-grpc", "sds-grpc", "prometheus_stats"]
    assert bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] == 15090
    # Istio's runtime limit, which validation holds regexes to (Envoy's default NACKs `\pL`).
    assert bootstrap["layered_runtime"]["layers"][0]["static_layer"]["re2.max_program_size.error_level"] == 32768
    for cluster in bootstrap["static_resources"]["clusters"][:2]:  # gRPC needs HTTP/2, or Envoy connects to nothing
        options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert options["explicit_http_config"] == {"http2_protocol_options": {}}
    merged = merge_override(bootstrap, {"admin": {"address": {"socket_address": {"port_value": 15001}}},
                                        "static_resources": {"clusters": [{"name": "extra"}]}})
    assert merged["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 15001}
    assert [c["name"] for c in merged["static_resources"]["clusters"]] == [
        "xds-grpc", "sds-grpc", "prometheus_stats", "extra"]
    assert bootstrap["admin"]["address"]["socket_address"]["port_value"] == 15000  # the input is not changed
    assert EnvoyAdmin(Path("/pod/admin")).bootstrap_address() == {"pipe": {"path": "/pod/admin"}}


def agent_proxy(workdir: Path, *extra: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "istiod", "agent", "--ca-addr", f"127.0.0.1:{free_port()}", "--pod-name", "web-1",
         "--pod-namespace", "app", "--instance-ip", "127.0.0.1", "proxy", "--workdir", str(workdir), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )


@pytest.mark.parametrize("problem", ["long workdir", "bad override", "bad metadata", "port in use"])
def test_start_up_mistakes_are_one_line(tmp_path: Path, problem: str) -> None:
    workdir, extra, env = tmp_path, [], dict(os.environ)
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    if problem == "port in use":
        extra = ["--status-addr", f"127.0.0.1:{port}", "--readiness-addr", "127.0.0.1:0"]
        expected = f"cannot serve in {tmp_path}, or on 127.0.0.1:{port} and 127.0.0.1:0: [Errno 98] Address already in use"
    elif problem == "long workdir":
        workdir = tmp_path / ("w" * 80)
        expected = f"the Unix socket path {workdir}/etc/istio/proxy/XDS is longer than the system's 107 bytes"
    elif problem == "bad override":
        (tmp_path / "override.yaml").write_text("- a list\n")
        extra = ["--bootstrap-override", str(tmp_path / "override.yaml")]
        expected = f"the bootstrap override {tmp_path}/override.yaml must be a map"
    else:
        env["ISTIO_METAJSON_LABELS"] = "{nope"
        expected = "ISTIO_METAJSON_LABELS is not JSON: Expecting property name enclosed in double quotes"
    with taken:
        result = agent_proxy(workdir, *extra, env=env)
    print(result.stderr.strip())
    assert result.returncode == 1
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

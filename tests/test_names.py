from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from istiod.model import names


def test_istio_names() -> None:
    assert names.service_hostname("echo", "demo") == "echo.demo.svc.cluster.local"
    assert names.service_hostname("echo", "demo", "corp.example") == "echo.demo.svc.corp.example"
    assert names.outbound_cluster_name(7070, "echo.demo.svc.cluster.local") == "outbound|7070||echo.demo.svc.cluster.local"
    assert names.outbound_cluster_name(80, "h", "v1") == "outbound|80|v1|h"
    assert names.inbound_cluster_name(8080) == "inbound|8080||"
    assert names.inbound_listener_name("10.0.0.1", 80) == "xds.istio.io/grpc/lds/inbound/10.0.0.1:80"
    assert names.inbound_listener_name("::1", 80) == "xds.istio.io/grpc/lds/inbound/[::1]:80"
    assert names.spiffe_identity("cluster.local", "demo", "echo") == "spiffe://cluster.local/ns/demo/sa/echo"
    assert names.listener_host_aliases("echo", "demo") == (
        "echo.demo.svc.cluster.local", "echo.demo.svc", "echo.demo",
    )


def test_parse_cluster_name() -> None:
    assert names.parse_cluster_name("outbound|7070||echo.demo.svc.cluster.local") == (
        "outbound", 7070, "", "echo.demo.svc.cluster.local",
    )
    for bad in ("outbound|x||h", "sideways|1||h", "outbound|1|h", ""):
        with pytest.raises(ValueError):
            names.parse_cluster_name(bad)


@pytest.mark.parametrize("bad", ["host", "host:", ":80", "host:0", "host:65536", "host:8o", "[::1]80"])
def test_split_host_port_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        names.split_host_port(bad)


@given(st.from_regex(r"[a-z0-9][a-z0-9.-]{0,40}", fullmatch=True) | st.ip_addresses().map(str), st.integers(1, 65535))
def test_host_port_round_trip(host: str, port: int) -> None:
    assert names.split_host_port(names.join_host_port(host, port)) == (host, port)


def test_split_host_port_listen_addresses() -> None:
    assert names.split_host_port(":0", allow_empty_host=True, allow_zero_port=True) == ("", 0)
    assert names.split_host_port("[::1]:0", allow_zero_port=True) == ("::1", 0)
    with pytest.raises(ValueError):
        names.split_host_port(":80", allow_zero_port=True)
    with pytest.raises(ValueError):
        names.split_host_port("host:0", allow_empty_host=True)

"""DestinationRule trafficPolicy.tunnel: the TCP proxies of sidecar and gateway listeners that reach
the host carry the bytes in an HTTP CONNECT (or POST) to targetHost:targetPort, as istiod's
tunnelingconfig.Apply (tests/test_envoy_tunnel.py proves it with a real Envoy and proxy)."""

from __future__ import annotations

from typing import Any

from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2

from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import SIDECAR
from istiod.model.proxy import proxy_from_node
from tests.test_gateway_gen import L4_ROUTES, _generate, _l4_gateway, _snapshot
from tests.test_sidecar_egress_gen import NODE, db_route, generate, snapshot

EXT = "tcp.external.test"


def tunnel_rule(subsets: str = "[]", host: str = EXT, namespace: str = "shop") -> str:
    return f"""
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {{name: tunnel, namespace: {namespace}}}
spec:
  host: {host}
  trafficPolicy:
    tunnel: {{protocol: CONNECT, targetHost: db.corp.test, targetPort: 5432}}
  subsets: {subsets}
"""


SUBSETS = ("[{name: post, trafficPolicy: {tunnel: {protocol: POST, targetHost: 10.1.2.3, targetPort: 8443}}},"
           " {name: plain, trafficPolicy: {loadBalancer: {simple: RANDOM}}}]")


def tcp_proxies(listener: listener_pb2.Listener) -> list[tcp_proxy_pb2.TcpProxy]:
    chains = [*listener.filter_chains, *([listener.default_filter_chain] if listener.HasField("default_filter_chain") else [])]
    found = []
    for chain in chains:
        for item in chain.filters:
            if item.name == "envoy.filters.network.tcp_proxy":
                found.append(tcp_proxy_pb2.TcpProxy.FromString(item.typed_config.value))
    return found


def tunneling(proxy: tcp_proxy_pb2.TcpProxy) -> tuple[str, bool] | None:
    if not proxy.HasField("tunneling_config"):
        return None
    return proxy.tunneling_config.hostname, proxy.tunneling_config.use_post


def listeners(*extra: str) -> dict[str, Any]:
    return generate(types.LISTENER, snapshot(*extra), listener_pb2.Listener)


def test_a_hosts_tcp_listener_tunnels_to_the_target() -> None:
    (proxy,) = tcp_proxies(listeners(tunnel_rule())["10.96.5.1_7000"])
    assert proxy.cluster == f"outbound|7000||{EXT}"
    assert tunneling(proxy) == ("db.corp.test:5432", False)
    # Without the rule's tunnel: a plain TCP proxy.
    (plain,) = tcp_proxies(listeners()["10.96.5.1_7000"])
    assert tunneling(plain) is None


def test_a_route_to_a_subset_takes_the_subsets_tunnel_only() -> None:
    """istiod: a single destination with a subset takes that subset's tunnel; a subset that sets
    none tunnels nothing (the rule's own is not inherited); a route from another host to the
    tunnelled one tunnels as the destination's rule says."""
    for subset, expected in (("post", ("10.1.2.3:8443", True)), ("plain", None), ("", ("db.corp.test:5432", False))):
        destination = f"{{host: {EXT}, subset: {subset}}}" if subset else f"{{host: {EXT}}}"
        found = listeners(tunnel_rule(SUBSETS), db_route(f"[{{route: [{{destination: {destination}}}]}}]"))
        (proxy,) = tcp_proxies(found["10.96.0.11_5432"])
        assert proxy.cluster == f"outbound|7000|{subset}|{EXT}"
        assert tunneling(proxy) == expected, subset


def test_a_weighted_split_takes_the_first_destinations_rule_without_its_subset() -> None:
    split = db_route(f"[{{route: [{{destination: {{host: {EXT}, subset: post}}, weight: 60}},"
                     " {destination: {host: db, subset: v2}, weight: 40}]}]")
    (proxy,) = tcp_proxies(listeners(tunnel_rule(SUBSETS), split)["10.96.0.11_5432"])
    assert [c.name for c in proxy.weighted_clusters.clusters] == [f"outbound|7000|post|{EXT}", "outbound|5432|v2|db.shop.svc.cluster.local"]
    assert tunneling(proxy) == ("db.corp.test:5432", False)
    # db first: db's rule has no tunnel, so the split does not tunnel.
    other_first = db_route(f"[{{route: [{{destination: {{host: db, subset: v2}}, weight: 40}},"
                           f" {{destination: {{host: {EXT}}}, weight: 60}}]}}]")
    (proxy,) = tcp_proxies(listeners(tunnel_rule(SUBSETS), other_first)["10.96.0.11_5432"])
    assert tunneling(proxy) is None


def test_tls_chains_by_sni_and_hosts_without_an_address_tunnel_too() -> None:
    found = listeners(tunnel_rule(host="b.tls.test"))
    by_sni = {tuple(chain.filter_chain_match.server_names): tcp_proxies(listener_pb2.Listener(filter_chains=[chain]))[0]
              for chain in found["10.96.0.14_443"].filter_chains}
    assert tunneling(by_sni[("b.tls.test",)]) == ("db.corp.test:5432", False)
    assert tunneling(by_sni[()]) is None  # the rest, to secure-1
    unaddressed = {tuple(chain.filter_chain_match.server_names): tcp_proxies(listener_pb2.Listener(filter_chains=[chain]))[0]
                   for chain in found["0.0.0.0_443"].filter_chains}
    assert tunneling(unaddressed[("b.tls.test",)]) == ("db.corp.test:5432", False)
    assert tunneling(tcp_proxies(listener_pb2.Listener(filter_chains=[found["0.0.0.0_443"].default_filter_chain]))[0]) is None


def test_http_ports_and_the_catch_all_never_tunnel() -> None:
    found = listeners(tunnel_rule(host="echo.external.test"), tunnel_rule(host='"*"'))
    for name in ("0.0.0.0_8090", "virtualOutbound"):
        assert all(tunneling(p) is None for p in tcp_proxies(found[name])), name


def test_a_changed_rule_rebuilds_the_listener_shared_in_the_cache() -> None:
    cache = ResourceCache()
    proxy = proxy_from_node(NODE, {"LABELS": {"app": "web"}})

    def ext_listener(*extra: str) -> listener_pb2.Listener:
        return next(listener_pb2.Listener.FromString(r.value) for r in SIDECAR[types.LISTENER](snapshot(*extra), proxy, None, cache)
                    if r.name == "10.96.5.1_7000")

    assert tunneling(tcp_proxies(ext_listener())[0]) is None
    assert tunneling(tcp_proxies(ext_listener(tunnel_rule()))[0]) == ("db.corp.test:5432", False)
    post = tunnel_rule().replace("protocol: CONNECT", "protocol: POST")
    assert tunneling(tcp_proxies(ext_listener(post))[0]) == ("db.corp.test:5432", True)


def test_a_rule_not_exported_to_the_proxy_does_not_tunnel() -> None:
    """The root namespace's rule applies where it is exported."""
    hidden = tunnel_rule(namespace="istio-system").replace("spec:", "spec:\n  exportTo: ['.']")
    assert tunneling(tcp_proxies(listeners(tunnel_rule(namespace="istio-system"))["10.96.5.1_7000"])[0]) is not None
    assert tunneling(tcp_proxies(listeners(hidden)["10.96.5.1_7000"])[0]) is None


GATEWAY_RULE = {"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule", "metadata": {"name": "web", "namespace": "shop"},
                "spec": {"host": "web.shop.svc.cluster.local",
                         "trafficPolicy": {"tunnel": {"protocol": "POST", "targetHost": "db.corp.test", "targetPort": 5432}},
                         "subsets": [{"name": "v1", "labels": {"version": "v1"}}]}}


def test_gateway_tcp_and_passthrough_servers_tunnel_but_auto_passthrough_does_not() -> None:
    gateway = _l4_gateway({"port": {"number": 9000, "name": "tcp", "protocol": "TCP"}, "hosts": ["shop/*"]},
                          {"port": {"number": 9443, "name": "tls", "protocol": "TLS"}, "hosts": ["shop/*.example.com"],
                           "tls": {"mode": "PASSTHROUGH"}},
                          {"port": {"number": 15443, "name": "auto", "protocol": "TLS"}, "hosts": ["*.local"],
                           "tls": {"mode": "AUTO_PASSTHROUGH"}})
    found = _generate(types.LISTENER, _snapshot(gateway, L4_ROUTES, GATEWAY_RULE), listener_pb2.Listener)
    for name in ("127.0.0.60_9000", "127.0.0.60_9443"):
        (proxy,) = tcp_proxies(found[name])
        assert tunneling(proxy) == ("db.corp.test:5432", True), name
    auto = tcp_proxies(found["127.0.0.60_15443"])
    assert len(auto) == 2 and all(tunneling(p) is None for p in auto)
    plain = _generate(types.LISTENER, _snapshot(gateway, L4_ROUTES), listener_pb2.Listener)
    assert tunneling(tcp_proxies(plain["127.0.0.60_9000"])[0]) is None

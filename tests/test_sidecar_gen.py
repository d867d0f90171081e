"""The sidecar generator's pure translation, on the data fixture: model in, Envoy protos out.
(tests/test_envoy_sidecar.py proves the same output with a real Envoy.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2 as http_options_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from hypothesis import given
from hypothesis import strategies as st

from istiod.model.builder import build_snapshot
from istiod.model.mesh import MeshConfig, OutboundTrafficPolicy
from istiod.model.protocol import Protocol, port_protocol
from istiod.model.proxy import proxy_from_node
from istiod.model.service import Port
from istiod.model.snapshot import Snapshot
from istiod.sources.fields import ConversionError
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen import PROXYLESS_GRPC, ROUTER, SIDECAR, WAYPOINT, generators_for

DATA = Path(__file__).parent / "data"
WEB = "web.shop.svc.cluster.local"
SIDECAR_NODE = "sidecar~127.0.0.31~web-1.shop~shop.svc.cluster.local"


def _snapshot(mesh: MeshConfig = MeshConfig()) -> Snapshot:
    store = Store()
    for document in yaml.safe_load_all((DATA / "sidecar-mesh.yaml").read_text()):
        store.apply(document)
    return build_snapshot(store, "v1", mesh=mesh)


def _generate(type_url: str, snapshot: Snapshot, node: str = SIDECAR_NODE, names: list[str] | None = None,
              message: Any = cluster_pb2.Cluster) -> dict[str, object]:
    proxy = proxy_from_node(node, {})
    resources: list[Resource] = SIDECAR[type_url](snapshot, proxy, names, ResourceCache())
    return {r.name: message.FromString(r.value) for r in resources}


def test_protocol_by_app_protocol_then_port_name_prefix() -> None:
    cases = {
        Port("http-web", 80): Protocol.HTTP, Port("HTTP2", 80): Protocol.HTTP2, Port("grpc", 80): Protocol.GRPC,
        Port("grpc-web-x", 80): Protocol.GRPC_WEB, Port("tcp-db", 80): Protocol.TCP, Port("redis", 80): Protocol.REDIS,
        Port("web", 80): Protocol.UNSUPPORTED, Port("", 80): Protocol.UNSUPPORTED,
        Port("http", 80, app_protocol="grpc"): Protocol.GRPC,  # appProtocol wins over the name
        Port("tcp", 80, app_protocol="kubernetes.io/h2c"): Protocol.HTTP2,
        Port("http", 53, protocol="UDP"): Protocol.UDP,
    }
    assert {port: port_protocol(port) for port in cases} == cases


@given(st.sampled_from(["http", "HTTP", "grpc", "http2", "tcp", "tls"]), st.from_regex(r"[a-z0-9-]{0,12}", fullmatch=True))
def test_any_suffix_after_the_first_dash_is_ignored(prefix: str, suffix: str) -> None:
    if prefix.lower() == "grpc" and suffix.startswith("web"):
        return  # grpc-web is a protocol of its own
    assert port_protocol(Port(f"{prefix}-{suffix}", 80)) == port_protocol(Port(prefix, 80))


def test_generators_by_node_type_and_metadata() -> None:
    assert generators_for(proxy_from_node(SIDECAR_NODE, {})) is SIDECAR
    assert generators_for(proxy_from_node(SIDECAR_NODE, {"GENERATOR": "grpc"})) is PROXYLESS_GRPC
    assert generators_for(proxy_from_node("router~10.0.0.1~gw-1.istio-system~istio-system.svc.cluster.local", {})) is ROUTER
    assert generators_for(proxy_from_node("waypoint~10.0.0.1~wp-1.istio-system~istio-system.svc.cluster.local", {})) is WAYPOINT


def test_outbound_clusters_use_auto_mtls_and_http2_for_grpc() -> None:
    clusters = _generate(types.CLUSTER, _snapshot())
    assert set(clusters) == {
        "BlackHoleCluster", "PassthroughCluster", "InboundPassthroughCluster", "inbound|8080||",
        f"outbound|80||{WEB}", "outbound|5432||db.shop.svc.cluster.local", "outbound|7070||rpc.shop.svc.cluster.local",
    }  # no cluster for db's UDP port 53
    web = clusters[f"outbound|80||{WEB}"]
    assert isinstance(web, cluster_pb2.Cluster)
    assert web.type == cluster_pb2.Cluster.EDS and web.eds_cluster_config.service_name == web.name
    assert web.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST and not web.typed_extension_protocol_options
    istio, disabled = web.transport_socket_matches
    assert (istio.name, dict(istio.match), disabled.name, dict(disabled.match)) == (
        "tlsMode-istio", {"tlsMode": "istio"}, "tlsMode-disabled", {})
    context = tls_pb2.UpstreamTlsContext.FromString(istio.transport_socket.typed_config.value)
    assert context.sni == f"outbound_.80_._.{WEB}"
    assert list(context.common_tls_context.alpn_protocols) == ["istio"]  # without metadata exchange, as Istio's
    assert [s.name for s in context.common_tls_context.tls_certificate_sds_secret_configs] == ["default"]
    validation = context.common_tls_context.combined_validation_context
    assert validation.validation_context_sds_secret_config.name == "ROOTCA"
    assert [m.matcher.exact for m in validation.default_validation_context.match_typed_subject_alt_names] == [
        "spiffe://cluster.local/ns/shop/sa/web"]
    rpc = clusters["outbound|7070||rpc.shop.svc.cluster.local"]
    assert isinstance(rpc, cluster_pb2.Cluster)
    assert list(rpc.typed_extension_protocol_options) == ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    inbound = clusters["inbound|8080||"]
    assert isinstance(inbound, cluster_pb2.Cluster)
    assert inbound.type == cluster_pb2.Cluster.ORIGINAL_DST and inbound.lb_policy == cluster_pb2.Cluster.CLUSTER_PROVIDED
    assert inbound.upstream_bind_config.source_address.address == "127.0.0.6"


def test_without_auto_mtls_only_a_destination_rule_turns_mtls_on() -> None:
    """meshConfig `enableAutoMtls: false`, as Istio: plaintext unless a DestinationRule says ISTIO_MUTUAL."""
    mesh = MeshConfig(enable_auto_mtls=False)
    web = _generate(types.CLUSTER, _snapshot(mesh))[f"outbound|80||{WEB}"]
    assert isinstance(web, cluster_pb2.Cluster)
    assert not web.transport_socket_matches and not web.HasField("transport_socket")
    store = Store()
    for document in yaml.safe_load_all((DATA / "sidecar-mesh.yaml").read_text()):
        store.apply(document)
    store.apply({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
                 "metadata": {"name": "web", "namespace": "shop"},
                 "spec": {"host": "web", "trafficPolicy": {"tls": {"mode": "ISTIO_MUTUAL"}}}})
    web = _generate(types.CLUSTER, build_snapshot(store, "v2", mesh=mesh))[f"outbound|80||{WEB}"]
    assert isinstance(web, cluster_pb2.Cluster)
    assert not web.transport_socket_matches and web.transport_socket.name == "envoy.transport_sockets.tls"


def test_sidecar_inbound_connection_pool_on_the_inbound_clusters() -> None:
    """A port's ingress listener pool wins over the Sidecar's inboundConnectionPool, as in istiod."""
    def inbound(spec: dict[str, object]) -> cluster_pb2.Cluster:
        store = Store()
        for document in yaml.safe_load_all((DATA / "sidecar-mesh.yaml").read_text()):
            store.apply(document)
        store.apply({"apiVersion": "networking.istio.io/v1", "kind": "Sidecar",
                     "metadata": {"name": "default", "namespace": "shop"}, "spec": spec})
        cluster = _generate(types.CLUSTER, build_snapshot(store, "v1"))["inbound|8080||"]
        assert isinstance(cluster, cluster_pb2.Cluster)
        return cluster

    pool = {"tcp": {"maxConnections": 7, "connectTimeout": "2s"}, "http": {"http2MaxRequests": 9}}
    threshold = inbound({"inboundConnectionPool": pool}).circuit_breakers.thresholds[0]
    assert (threshold.max_connections.value, threshold.max_requests.value) == (7, 9)
    assert inbound({"inboundConnectionPool": pool}).connect_timeout.seconds == 2
    by_port = inbound({"inboundConnectionPool": pool, "ingress": [
        {"port": {"number": 8080, "protocol": "HTTP", "name": "http"}, "connectionPool": {"tcp": {"maxConnections": 3}}}]})
    assert by_port.circuit_breakers.thresholds[0].max_connections.value == 3
    assert by_port.circuit_breakers.thresholds[0].max_requests.value == 4294967295  # only the port's pool applies



def test_the_served_services_destination_rule_pool_on_the_inbound_cluster() -> None:
    """istiod seeds an inbound cluster with the connection pool of the served service's
    DestinationRule (its port's settings), which a Sidecar's inbound pool then replaces."""
    store = Store()
    for document in yaml.safe_load_all((DATA / "sidecar-mesh.yaml").read_text()):
        store.apply(document)
    store.apply({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
                 "metadata": {"name": "web", "namespace": "shop"},
                 "spec": {"host": "web", "trafficPolicy": {
                     "connectionPool": {"tcp": {"maxConnections": 11}},
                     "portLevelSettings": [{"port": {"number": 80}, "connectionPool": {"tcp": {"maxConnections": 12}}}]}}})
    inbound = _generate(types.CLUSTER, build_snapshot(store, "v1"))["inbound|8080||"]
    assert isinstance(inbound, cluster_pb2.Cluster)
    assert inbound.circuit_breakers.thresholds[0].max_connections.value == 12  # web's port 80 targets 8080
    store.apply({"apiVersion": "networking.istio.io/v1", "kind": "Sidecar", "metadata": {"name": "default", "namespace": "shop"},
                 "spec": {"inboundConnectionPool": {"tcp": {"maxConnections": 5}}}})
    inbound = _generate(types.CLUSTER, build_snapshot(store, "v2"))["inbound|8080||"]
    assert isinstance(inbound, cluster_pb2.Cluster)
    assert inbound.circuit_breakers.thresholds[0].max_connections.value == 5


def test_endpoints_carry_tls_mode_only_for_pods_with_a_sidecar() -> None:
    snapshot = _generate(types.ENDPOINT, _snapshot(), names=[f"outbound|80||{WEB}", "outbound|5432||db.shop.svc.cluster.local"],
                         message=endpoint_pb2.ClusterLoadAssignment)
    web, db = (a.endpoints[0].lb_endpoints[0] for a in snapshot.values())  # type: ignore[attr-defined]
    assert dict(web.metadata.filter_metadata["envoy.transport_socket_match"]) == {"tlsMode": "istio"}
    assert not db.HasField("metadata")


def _chains(listener: listener_pb2.Listener, name: str) -> list[listener_pb2.FilterChain]:
    return [chain for chain in listener.filter_chains if chain.name == name]


def _match(chain: listener_pb2.FilterChain) -> tuple[int, str, list[str]]:
    match = chain.filter_chain_match
    return match.destination_port.value, match.transport_protocol, list(match.application_protocols)


def test_inbound_is_permissive_unless_mtls_is_strict() -> None:
    permissive = _generate(types.LISTENER, _snapshot(), message=listener_pb2.Listener)["virtualInbound"]
    assert isinstance(permissive, listener_pb2.Listener)
    mtls, plaintext = _chains(permissive, "0.0.0.0_8080")
    assert _match(mtls) == (8080, "tls", ["istio", "istio-peer-exchange", "istio-http/1.0", "istio-http/1.1", "istio-h2"])
    context = tls_pb2.DownstreamTlsContext.FromString(mtls.transport_socket.typed_config.value)
    assert context.require_client_certificate.value
    assert list(context.common_tls_context.alpn_protocols) == ["h2", "http/1.1"]
    assert _match(plaintext) == (8080, "raw_buffer", []) and not plaintext.HasField("transport_socket")
    # Istio's catch-all chains for ports no service names, in Istio's order.
    assert [(c.name, _match(c), c.HasField("transport_socket")) for c in permissive.filter_chains
            if c.name.startswith("virtualInbound") and not c.name.endswith("blackhole")] == [
        ("virtualInbound-catchall-http", (0, "tls", ["istio-http/1.0", "istio-http/1.1", "istio-h2"]), True),
        ("virtualInbound-catchall-http", (0, "raw_buffer", ["http/1.1", "h2c"]), False),
        ("virtualInbound", (0, "tls", ["istio-peer-exchange", "istio"]), True),
        ("virtualInbound", (0, "raw_buffer", []), False),
        ("virtualInbound", (0, "tls", []), False),
    ]
    assert not permissive.HasField("default_filter_chain")
    inspector = permissive.listener_filters[-1]
    assert inspector.name == "envoy.filters.listener.http_inspector"
    assert [(r.destination_port_range.start, r.destination_port_range.end)
            for r in inspector.filter_disabled.or_match.rules] == [(8080, 8081), (15006, 15007)]

    strict = _generate(types.LISTENER, _snapshot(MeshConfig(mtls=True)), message=listener_pb2.Listener)["virtualInbound"]
    assert isinstance(strict, listener_pb2.Listener)
    assert all(c.filter_chain_match.transport_protocol == "tls" for c in strict.filter_chains[1:])  # no plaintext
    assert not strict.HasField("default_filter_chain")  # plaintext matches nothing and is closed
    assert [_match(c) for c in _chains(strict, "0.0.0.0_8080")] == [(8080, "tls", [])]
    assert [_match(c) for c in strict.filter_chains if c.name.startswith("virtualInbound-catchall")] == [
        (0, "tls", ["istio-http/1.0", "istio-http/1.1", "istio-h2"])]
    assert all(f.name != "envoy.filters.listener.http_inspector" for f in strict.listener_filters)


def test_outbound_listeners_never_bind() -> None:
    listeners = _generate(types.LISTENER, _snapshot(), message=listener_pb2.Listener)
    for name in ("0.0.0.0_80", "0.0.0.0_7070", "10.96.0.11_5432"):
        listener = listeners[name]
        assert isinstance(listener, listener_pb2.Listener)
        assert listener.HasField("bind_to_port") and not listener.bind_to_port.value
    tcp = listeners["10.96.0.11_5432"]
    assert isinstance(tcp, listener_pb2.Listener)
    proxy = tcp_proxy_pb2.TcpProxy.FromString(tcp.filter_chains[0].filters[0].typed_config.value)
    assert proxy.cluster == "outbound|5432||db.shop.svc.cluster.local"
    outbound = _generate(types.LISTENER, _snapshot(MeshConfig(outbound_traffic_policy=OutboundTrafficPolicy.REGISTRY_ONLY)),
                         message=listener_pb2.Listener)["virtualOutbound"]
    assert isinstance(outbound, listener_pb2.Listener)
    catch_all = outbound.filter_chains[-1]
    unmatched = tcp_proxy_pb2.TcpProxy.FromString(catch_all.filters[0].typed_config.value)
    assert (catch_all.name, unmatched.cluster) == ("virtualOutbound-catchall-tcp", "BlackHoleCluster")


def test_outbound_http_ports_take_what_the_http_inspector_recognises_and_pass_the_rest() -> None:
    for mesh, cluster in ((MeshConfig(), "PassthroughCluster"),
                          (MeshConfig(outbound_traffic_policy=OutboundTrafficPolicy.REGISTRY_ONLY), "BlackHoleCluster")):
        listener = _generate(types.LISTENER, _snapshot(mesh), message=listener_pb2.Listener)["0.0.0.0_80"]
        assert isinstance(listener, listener_pb2.Listener)
        assert [f.name for f in listener.listener_filters] == ["envoy.filters.listener.http_inspector"]
        (http,) = listener.filter_chains
        assert (http.filter_chain_match.transport_protocol, list(http.filter_chain_match.application_protocols)) == (
            "raw_buffer", ["http/1.1", "h2c"])
        assert http.filters[0].name == "envoy.filters.network.http_connection_manager"
        rest = tcp_proxy_pb2.TcpProxy.FromString(listener.default_filter_chain.filters[0].typed_config.value)
        assert rest.cluster == cluster


def test_route_domains_depend_on_the_proxys_namespace_and_stay_unique() -> None:
    snapshot = _snapshot()
    same = _generate(types.ROUTE, snapshot, names=["80"], message=route_pb2.RouteConfiguration)["80"]
    other = _generate(types.ROUTE, snapshot, node="sidecar~127.0.0.40~x-1.other~other.svc.cluster.local",
                      names=["80"], message=route_pb2.RouteConfiguration)["80"]
    assert isinstance(same, route_pb2.RouteConfiguration) and isinstance(other, route_pb2.RouteConfiguration)
    # Istio's: no ports (Envoy ignores the Host header's), the FQDN also absolute.
    assert list(same.virtual_hosts[0].domains) == [
        WEB, f"{WEB}.", "web", "web.shop.svc", "web.shop", "10.96.0.10"] and same.ignore_port_in_host_matching
    assert list(other.virtual_hosts[0].domains) == [WEB, f"{WEB}.", "web.shop.svc", "web.shop", "10.96.0.10"]
    retries = same.virtual_hosts[0].routes[0].route.retry_policy  # istiod's default
    assert (retries.num_retries.value, retries.retry_host_predicate[0].name) == (2, "envoy.retry_host_predicates.previous_hosts")

    # Two services claiming one ClusterIP: the VIP stays with the first, or Envoy rejects the routes.
    web = snapshot.services[WEB]
    twin = dataclasses.replace(web, name="web-twin")
    crowded = dataclasses.replace(snapshot, services={**snapshot.services, twin.hostname: twin})
    hosts = _generate(types.ROUTE, crowded, names=["80"], message=route_pb2.RouteConfiguration)["80"].virtual_hosts  # type: ignore[attr-defined]
    domains = [d for host in hosts for d in host.domains]
    assert len(domains) == len(set(domains))
    assert "10.96.0.10" in hosts[0].domains and "10.96.0.10" not in hosts[1].domains


def test_two_services_on_one_vip_and_tcp_port_make_one_listener() -> None:
    snapshot = _snapshot()
    db = snapshot.services["db.shop.svc.cluster.local"]
    twin = dataclasses.replace(db, name="db-twin")
    crowded = dataclasses.replace(snapshot, services={**snapshot.services, twin.hostname: twin})
    proxy = proxy_from_node(SIDECAR_NODE, {})
    names = [r.name for r in SIDECAR[types.LISTENER](crowded, proxy, None, ResourceCache())]
    assert names.count("10.96.0.11_5432") == 1 and len(names) == len(set(names))


def test_addresses_envoy_would_reject_are_left_out() -> None:
    snapshot = _snapshot()
    web = snapshot.services[WEB]
    scoped = dataclasses.replace(web, cluster_ip="fe80::1%eth0")
    endpoints = {**snapshot.endpoints, (WEB, 80): tuple(
        dataclasses.replace(e, address=address) for e in snapshot.endpoints[(WEB, 80)] for address in ("not-an-ip", e.address))}
    odd = dataclasses.replace(snapshot, services={**snapshot.services, WEB: scoped}, endpoints=endpoints)
    assignment = _generate(types.ENDPOINT, odd, names=[f"outbound|80||{WEB}"],
                           message=endpoint_pb2.ClusterLoadAssignment)[f"outbound|80||{WEB}"]
    assert [e.endpoint.address.socket_address.address  # type: ignore[attr-defined]
            for group in assignment.endpoints for e in group.lb_endpoints] == ["127.0.0.31"]  # type: ignore[attr-defined]
    route = _generate(types.ROUTE, odd, names=["80"], message=route_pb2.RouteConfiguration)["80"]
    assert not any("fe80" in d for d in route.virtual_hosts[0].domains)  # type: ignore[attr-defined]


def _sniffed(mesh: MeshConfig = MeshConfig()) -> Snapshot:
    """The fixture with web's and db's ports named without a protocol (Istio sniffs them)."""
    text = (DATA / "sidecar-mesh.yaml").read_text()
    text = text.replace("{name: http-web, port: 80", "{name: web, port: 80").replace("{name: tcp, port: 5432}", "{name: db, port: 5432}")
    store = Store()
    for document in yaml.safe_load_all(text):
        store.apply(document)
    return build_snapshot(store, "v1", mesh=mesh)


def test_a_sniffed_port_takes_http_to_its_own_routes_and_the_rest_to_tcp_proxy() -> None:
    snapshot = _sniffed()
    listeners = _generate(types.LISTENER, snapshot, message=listener_pb2.Listener)
    assert "0.0.0.0_80" not in listeners  # a sniffed port listens on its VIP, as istiod
    for name, route in (("10.96.0.11_5432", "db.shop.svc.cluster.local:5432"), ("10.96.0.10_80", f"{WEB}:80")):
        listener = listeners[name]
        assert isinstance(listener, listener_pb2.Listener)
        assert [f.name for f in listener.listener_filters] == ["envoy.filters.listener.http_inspector"]
        assert listener.listener_filters_timeout.ToNanoseconds() == 0 and listener.continue_on_listener_filters_timeout
        (http,), tcp = listener.filter_chains, listener.default_filter_chain
        assert not tcp.HasField("filter_chain_match") and tcp.filters[0].name == "envoy.filters.network.tcp_proxy"
        assert _match(http) == (0, "raw_buffer", ["http/1.1", "h2c"])
        manager = hcm_pb2.HttpConnectionManager.FromString(http.filters[0].typed_config.value)
        assert manager.rds.route_config_name == route
    routes = _generate(types.ROUTE, snapshot, message=route_pb2.RouteConfiguration)
    assert sorted(routes) == ["7070", "db.shop.svc.cluster.local:5432", f"{WEB}:80"]
    db = routes["db.shop.svc.cluster.local:5432"]
    assert isinstance(db, route_pb2.RouteConfiguration)
    # istiod's: the one service for any Host, no catch-all.
    assert [(h.name, list(h.domains)) for h in db.virtual_hosts] == [("db.shop.svc.cluster.local:5432", ["*"])]
    assert db.virtual_hosts[0].routes[0].route.cluster == "outbound|5432||db.shop.svc.cluster.local"
    # The upstream speaks what the client spoke (istiod's use_downstream_protocol).
    cluster = _generate(types.CLUSTER, snapshot)["outbound|5432||db.shop.svc.cluster.local"]
    assert isinstance(cluster, cluster_pb2.Cluster)
    options = http_options_pb2.HttpProtocolOptions.FromString(
        cluster.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].value)
    assert options.HasField("use_downstream_protocol_config")


def test_a_sniffed_inbound_port_has_http_and_tcp_chains_and_the_http_inspector_runs_on_it() -> None:
    for mesh, expected in (
        (MeshConfig(), [("tls", ["istio-http/1.0", "istio-http/1.1", "istio-h2"], True),
                        ("raw_buffer", ["http/1.1", "h2c"], True), ("tls", ["istio-peer-exchange", "istio"], False),
                        ("raw_buffer", [], False), ("tls", [], False)]),
        (MeshConfig(mtls=True), [("tls", ["istio-http/1.0", "istio-http/1.1", "istio-h2"], True), ("tls", [], False)]),
    ):
        inbound = _generate(types.LISTENER, _sniffed(mesh), message=listener_pb2.Listener)["virtualInbound"]
        assert isinstance(inbound, listener_pb2.Listener)
        chains = _chains(inbound, "0.0.0.0_8080")
        assert [(_match(c)[1], _match(c)[2], c.filters[0].name.endswith("http_connection_manager")) for c in chains] == expected
        assert {_match(c)[0] for c in chains} == {8080}
        if not mesh.mtls:  # the HTTP inspector is off only on declared ports
            inspector = inbound.listener_filters[-1]
            assert inspector.name == "envoy.filters.listener.http_inspector"
            assert inspector.filter_disabled.destination_port_range.start == 15006


def test_protocol_detection_timeout_from_the_mesh_config() -> None:
    snapshot = _sniffed(MeshConfig(protocol_detection_timeout=0.1))
    listeners = _generate(types.LISTENER, snapshot, message=listener_pb2.Listener)
    for name in ("10.96.0.11_5432", "virtualInbound"):
        assert listeners[name].listener_filters_timeout.ToMilliseconds() == 100  # type: ignore[attr-defined]


EXPORT_TO = """
apiVersion: v1
kind: Service
metadata: {name: private, namespace: billing, annotations: {networking.istio.io/exportTo: " ., shop "}}
spec: {clusterIP: 10.96.9.1, ports: [{name: http, port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: hidden, namespace: billing, annotations: {networking.istio.io/exportTo: "."}}
spec: {clusterIP: 10.96.9.2, ports: [{name: http, port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: plain, namespace: billing}
spec: {clusterIP: 10.96.9.3, ports: [{name: http, port: 80}]}
"""


def test_service_export_to_annotation_and_the_mesh_default() -> None:
    def seen(mesh: MeshConfig, namespace: str) -> list[str]:
        snapshot = _built(EXPORT_TO, mesh)
        node = f"sidecar~127.0.0.50~x-1.{namespace}~{namespace}.svc.cluster.local"
        clusters = _generate(types.CLUSTER, snapshot, node=node)
        return sorted(name.split("|")[3].split(".")[0] for name in clusters if name.startswith("outbound|"))

    assert _built(EXPORT_TO).services["private.billing.svc.cluster.local"].export_to == (".", "shop")
    assert seen(MeshConfig(), "shop") == ["plain", "private"]
    assert seen(MeshConfig(), "billing") == ["hidden", "plain", "private"]
    assert seen(MeshConfig(), "other") == ["plain"]
    # The mesh's default applies to Services without the annotation only.
    assert seen(MeshConfig(default_service_export_to=(".",)), "shop") == ["private"]
    assert seen(MeshConfig(default_service_export_to=("~",)), "billing") == ["hidden", "private"]


def _built(text: str, mesh: MeshConfig = MeshConfig()) -> Snapshot:
    store = Store()
    for document in yaml.safe_load_all(text):
        store.apply(document)
    return build_snapshot(store, "v1", mesh=mesh)


EXTERNAL_NAME = """
apiVersion: v1
kind: Service
metadata: {name: ext, namespace: shop}
spec:
  type: ExternalName
  externalName: Web.Shop.svc.cluster.local.
  selector: {app: web}
  ports: [{name: http, port: 80}, {name: tcp-db, port: 5433}]
"""


def test_an_external_name_service_is_an_alias_of_the_host_it_names() -> None:
    store = Store()
    for document in [*yaml.safe_load_all((DATA / "sidecar-mesh.yaml").read_text()), yaml.safe_load(EXTERNAL_NAME)]:
        store.apply(document)
    snapshot = build_snapshot(store, "v1")
    assert snapshot.services["ext.shop.svc.cluster.local"].external_name == "web.shop.svc.cluster.local"
    # No config of its own (istiod's resolution Alias): no cluster, listener or virtual host.
    assert not any("ext.shop" in name for name in _generate(types.CLUSTER, snapshot))
    assert "0.0.0.0_5433" not in _generate(types.LISTENER, snapshot, message=listener_pb2.Listener)
    route = _generate(types.ROUTE, snapshot, names=["80"], message=route_pb2.RouteConfiguration)["80"]
    assert isinstance(route, route_pb2.RouteConfiguration)
    # Its names are on the virtual host of the service it names.
    (web,) = [h for h in route.virtual_hosts if h.name == f"{WEB}:80"]
    assert list(web.domains) == [WEB, f"{WEB}.", "web", "web.shop.svc", "web.shop", "ext.shop.svc.cluster.local",
                                 "ext.shop.svc.cluster.local.", "ext", "ext.shop.svc", "ext.shop", "10.96.0.10"]
    with pytest.raises(ConversionError, match="spec.externalName 'not a name' is not a DNS-1123 subdomain"):
        store.apply(yaml.safe_load(EXTERNAL_NAME.replace("Web.Shop.svc.cluster.local.", "not a name")))


HEADLESS = """
apiVersion: v1
kind: Service
metadata: {name: hl, namespace: shop}
spec:
  clusterIP: None
  selector: {app: hl}
  ports: [{name: http, port: 8080}, {name: tcp, port: 6379}, {port: 7000}]
""" + "".join(f"""---
apiVersion: v1
kind: Pod
metadata: {{name: hl-{i}, namespace: shop, labels: {{app: hl}}}}
spec: {{containers: [{{name: app, ports: [{{containerPort: 8080}}, {{containerPort: 6379}}, {{containerPort: 7000}}]}}]}}
status: {{phase: Running, podIP: 10.1.0.{i + 1}, conditions: [{{type: Ready, status: "True"}}]}}
""" for i in range(2))


def test_a_headless_service_has_original_dst_clusters_per_endpoint_listeners_and_pod_names() -> None:
    snapshot = _built(HEADLESS)
    clusters = _generate(types.CLUSTER, snapshot)
    for port in (8080, 6379, 7000):
        cluster = clusters[f"outbound|{port}||hl.shop.svc.cluster.local"]
        assert isinstance(cluster, cluster_pb2.Cluster)
        assert (cluster.type, cluster.lb_policy) == (cluster_pb2.Cluster.ORIGINAL_DST, cluster_pb2.Cluster.CLUSTER_PROVIDED)
        assert not cluster.transport_socket_matches  # the original destination carries no tlsMode
    gateway = _generate(types.CLUSTER, snapshot, node="router~10.0.0.9~gw-1.shop~shop.svc.cluster.local")
    assert gateway["outbound|8080||hl.shop.svc.cluster.local"].type == cluster_pb2.Cluster.EDS  # type: ignore[attr-defined]
    listeners = _generate(types.LISTENER, snapshot, message=listener_pb2.Listener)
    assert {"10.1.0.1_6379", "10.1.0.2_6379", "10.1.0.1_7000", "10.1.0.2_7000", "0.0.0.0_8080"} <= set(listeners)
    sniffed = listeners["10.1.0.2_7000"]
    assert isinstance(sniffed, listener_pb2.Listener) and sniffed.listener_filters[-1].name.endswith("http_inspector")
    routes = _generate(types.ROUTE, snapshot, message=route_pb2.RouteConfiguration)
    host = next(h for h in routes["8080"].virtual_hosts if h.name == "hl.shop.svc.cluster.local:8080")  # type: ignore[attr-defined]
    assert "*.hl.shop.svc.cluster.local" in host.domains and "*.hl" in host.domains  # hl-0.hl.shop.svc...
    assert "hl.shop.svc.cluster.local:7000" in routes


PASSTHROUGH_ENTRIES = """
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: wild, namespace: shop}
spec:
  hosts: ["*.example.test"]
  ports: [{number: 8090, name: http, protocol: HTTP}, {number: 443, name: tls, protocol: TLS}]
  resolution: NONE
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: cidr, namespace: shop}
spec:
  hosts: [cidr.example.net]
  addresses: [10.96.9.0/24]
  ports: [{number: 7100, name: tcp, protocol: TCP}]
  resolution: NONE
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: one, namespace: shop}
spec:
  hosts: [one.example.net]
  addresses: [10.96.9.77/32]
  ports: [{number: 7200, name: tcp, protocol: TCP}]
  resolution: NONE
"""


def test_none_resolution_and_wildcard_entries_pass_through_to_the_original_destination() -> None:
    """istiod's Passthrough: ORIGINAL_DST clusters (EDS on gateways); HTTP by the wildcard domain on
    0.0.0.0_<port>, TLS by SNI there, a CIDR address by a destination match, a /32 as an address."""
    snapshot = _built(PASSTHROUGH_ENTRIES, MeshConfig(outbound_traffic_policy=OutboundTrafficPolicy.REGISTRY_ONLY))
    clusters = _generate(types.CLUSTER, snapshot)
    for name in ("outbound|8090||*.example.test", "outbound|443||*.example.test", "outbound|7100||cidr.example.net",
                 "outbound|7200||one.example.net"):
        cluster = clusters[name]
        assert isinstance(cluster, cluster_pb2.Cluster)
        assert (cluster.type, cluster.lb_policy) == (cluster_pb2.Cluster.ORIGINAL_DST, cluster_pb2.Cluster.CLUSTER_PROVIDED)
        assert not cluster.transport_socket_matches and not cluster.HasField("eds_cluster_config")
    gateway = _generate(types.CLUSTER, snapshot, node="router~10.0.0.9~gw-1.shop~shop.svc.cluster.local")
    assert gateway["outbound|443||*.example.test"].type == cluster_pb2.Cluster.EDS  # type: ignore[attr-defined]
    routes = _generate(types.ROUTE, snapshot, message=route_pb2.RouteConfiguration)
    hosts = {h.name: list(h.domains) for h in routes["8090"].virtual_hosts}  # type: ignore[attr-defined]
    assert hosts["*.example.test:8090"] == ["*.example.test", "*.example.test."] and hosts["block_all"] == ["*"]
    listeners = _generate(types.LISTENER, snapshot, message=listener_pb2.Listener)
    tls = listeners["0.0.0.0_443"]
    assert isinstance(tls, listener_pb2.Listener)
    by_sni = {tuple(c.filter_chain_match.server_names): c.filters[0] for c in tls.filter_chains}
    assert tcp_proxy_pb2.TcpProxy.FromString(by_sni[("*.example.test",)].typed_config.value).cluster == \
        "outbound|443||*.example.test"
    assert list(by_sni) == [("*.example.test",)] and tls.default_filter_chain.name == "BlackHoleFilterChain"
    cidr = listeners["0.0.0.0_7100"]
    assert isinstance(cidr, listener_pb2.Listener)
    [first] = cidr.filter_chains
    assert [(r.address_prefix, r.prefix_len.value) for r in first.filter_chain_match.prefix_ranges] == [("10.96.9.0", 24)]
    assert tcp_proxy_pb2.TcpProxy.FromString(first.filters[0].typed_config.value).cluster == "outbound|7100||cidr.example.net"
    assert tcp_proxy_pb2.TcpProxy.FromString(cidr.default_filter_chain.filters[0].typed_config.value).cluster == \
        "BlackHoleCluster"
    assert "10.96.9.77_7200" in listeners


UNADDRESSED_ROUTES = """
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: tls-ext, namespace: shop}
spec:
  hosts: [a.tls.test, b.tls.test]
  ports: [{number: 443, name: tls, protocol: TLS}]
  resolution: DNS
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: tcp-ext, namespace: shop}
spec:
  hosts: [db.ext.test, db2.ext.test]
  ports: [{number: 5433, name: tcp, protocol: TCP}]
  resolution: DNS
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: tls, namespace: shop}
spec:
  hosts: [a.tls.test, x.tls.test]
  tls:
  - match: [{sniHosts: [a.tls.test, x.tls.test], port: 443}]
    route: [{destination: {host: b.tls.test}}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: tcp, namespace: shop}
spec:
  hosts: [db.ext.test]
  tcp:
  - match: [{port: 5433}]
    route: [{destination: {host: db2.ext.test}}]
"""


def test_virtual_service_tcp_and_tls_routes_for_entry_hosts_without_addresses() -> None:
    """On 0.0.0.0_<port>: `tls` routes by their sniHosts (instead of the host's own SNI chain),
    `tcp` routes by port for the host that takes the port."""
    listeners = _generate(types.LISTENER, _built(UNADDRESSED_ROUTES), message=listener_pb2.Listener)

    def chains(name: str) -> dict[tuple[str, ...], str]:
        listener = listeners[name]
        assert isinstance(listener, listener_pb2.Listener)
        found = [*listener.filter_chains, *([listener.default_filter_chain] if listener.HasField("default_filter_chain")
                                           else [])]
        return {tuple(c.filter_chain_match.server_names): tcp_proxy_pb2.TcpProxy.FromString(
            c.filters[0].typed_config.value).cluster for c in found}

    assert chains("0.0.0.0_443") == {("a.tls.test", "x.tls.test"): "outbound|443||b.tls.test",
                                     ("b.tls.test",): "outbound|443||b.tls.test", (): "PassthroughCluster"}
    assert chains("0.0.0.0_5433") == {(): "outbound|5433||db2.ext.test"}

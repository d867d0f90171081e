"""The sidecar generator's TCP routes, Sidecar egress listeners and ServiceEntry clusters: model in,
Envoy protos out (tests/test_envoy_tcp_egress.py proves the same with a real Envoy)."""

from __future__ import annotations

from typing import Any

import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2 as http_options_pb2

from istiod.model.builder import build_snapshot
from istiod.model.mesh import MeshConfig, OutboundTrafficPolicy
from istiod.model.proxy import proxy_from_node
from istiod.model.snapshot import Snapshot
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import PROXYLESS_GRPC, SIDECAR
from istiod.xds.gen.sidecar.clusters import HTTP_OPTIONS
from tests.conftest import DATA

NODE = "sidecar~127.0.0.31~web-1.shop~shop.svc.cluster.local"
DB = "db.shop.svc.cluster.local"


def snapshot(*extra: str, mesh: MeshConfig = MeshConfig()) -> Snapshot:
    """sidecar-mesh.yaml and tcp-egress.yaml, plus `extra` YAML documents."""
    store = Store()
    text = "\n---\n".join([(DATA / "sidecar-mesh.yaml").read_text(), (DATA / "tcp-egress.yaml").read_text(), *extra])
    for document in yaml.safe_load_all(text):
        if document:
            store.apply(document)
    return build_snapshot(store, "v1", mesh=mesh)


def generate(type_url: str, snap: Snapshot, message: Any, labels: dict[str, str] | None = None) -> dict[str, Any]:
    proxy = proxy_from_node(NODE, {"LABELS": labels or {"app": "web"}})
    return {r.name: message.FromString(r.value) for r in SIDECAR[type_url](snap, proxy, None, ResourceCache())}


def tcp_proxy_of(listener: listener_pb2.Listener) -> tcp_proxy_pb2.TcpProxy:
    config = tcp_proxy_pb2.TcpProxy()
    listener.filter_chains[0].filters[0].typed_config.Unpack(config)
    return config


def db_route(tcp: str) -> str:
    return f"""
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: db, namespace: shop}}
spec:
  hosts: [db]
  tcp: {tcp}
"""


def test_tcp_route_to_a_subset_and_a_weighted_split() -> None:
    to_subset = db_route("[{match: [{port: 5432}], route: [{destination: {host: db, subset: v2}}]}]")
    proxy = tcp_proxy_of(generate(types.LISTENER, snapshot(to_subset), listener_pb2.Listener)["10.96.0.11_5432"])
    assert proxy.cluster == f"outbound|5432|v2|{DB}"
    split = db_route("[{route: [{destination: {host: db, subset: v2}, weight: 70},"
                     " {destination: {host: tcp.external.test}, weight: 30}]}]")
    proxy = tcp_proxy_of(generate(types.LISTENER, snapshot(split), listener_pb2.Listener)["10.96.0.11_5432"])
    assert [(c.name, c.weight) for c in proxy.weighted_clusters.clusters] == [
        (f"outbound|5432|v2|{DB}", 70), ("outbound|7000||tcp.external.test", 30)]


def test_tcp_matches_that_do_not_hold_fall_back_to_the_service() -> None:
    """Port, source labels and destination subnets, decided per listener and proxy."""
    routes = db_route("[{match: [{port: 9999}], route: [{destination: {host: db, subset: v2}}]},"
                      " {match: [{sourceLabels: {app: other}}], route: [{destination: {host: db, subset: v2}}]},"
                      " {match: [{destinationSubnets: [10.97.0.0/16]}], route: [{destination: {host: db, subset: v2}}]}]")
    listeners = generate(types.LISTENER, snapshot(routes), listener_pb2.Listener)
    assert tcp_proxy_of(listeners["10.96.0.11_5432"]).cluster == f"outbound|5432||{DB}"
    other = generate(types.LISTENER, snapshot(routes), listener_pb2.Listener, labels={"app": "other"})
    assert tcp_proxy_of(other["10.96.0.11_5432"]).cluster == f"outbound|5432|v2|{DB}"
    subnet = db_route("[{match: [{destinationSubnets: [10.96.0.0/24]}], route: [{destination: {host: db, subset: v2}}]}]")
    listeners = generate(types.LISTENER, snapshot(subnet), listener_pb2.Listener)
    assert tcp_proxy_of(listeners["10.96.0.11_5432"]).cluster == f"outbound|5432|v2|{DB}"


SIDECAR_RESOURCE = """
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: shop}
spec:
  outboundTrafficPolicy: {mode: REGISTRY_ONLY}
  egress:
  - port: {number: 15432, protocol: TCP, name: tcp}
    hosts: [./db.shop.svc.cluster.local]
  - port: {number: 15433, protocol: TCP, name: tcp-local}
    bind: 127.0.0.1
    captureMode: NONE
    hosts: [./db.shop.svc.cluster.local]
  - hosts: [./web.shop.svc.cluster.local, "*/*.external.test"]
"""


def test_sidecar_egress_listeners_narrow_hosts_move_ports_and_set_the_policy() -> None:
    snap = snapshot(SIDECAR_RESOURCE)
    listeners = generate(types.LISTENER, snap, listener_pb2.Listener)
    assert set(listeners) == {"virtualOutbound", "virtualInbound", "10.96.0.11_15432", "127.0.0.1_15433",
                              "0.0.0.0_80", "10.96.5.1_7000", "0.0.0.0_8090"}
    assert tcp_proxy_of(listeners["10.96.0.11_15432"]).cluster == f"outbound|5432||{DB}"
    assert not listeners["10.96.0.11_15432"].bind_to_port.value
    local = listeners["127.0.0.1_15433"]
    assert local.bind_to_port.value and local.address.socket_address.address == "127.0.0.1"
    outbound = listeners["virtualOutbound"]
    assert tcp_proxy_of(listener_pb2.Listener(filter_chains=[outbound.filter_chains[-1]])).cluster == \
        "BlackHoleCluster"
    clusters = generate(types.CLUSTER, snap, cluster_pb2.Cluster)
    assert f"outbound|5432||{DB}" in clusters and "outbound|7070||rpc.shop.svc.cluster.local" not in clusters
    routes = generate(types.ROUTE, snap, route_pb2.RouteConfiguration)
    assert [h.name for h in routes["80"].virtual_hosts] == ["web.shop.svc.cluster.local:80", "block_all"]
    # Without the Sidecar resource: every service, the mesh's policy.
    assert "0.0.0.0_7070" in generate(types.LISTENER, snapshot(), listener_pb2.Listener)


def test_a_sidecar_resource_of_another_workload_changes_nothing() -> None:
    selective = SIDECAR_RESOURCE.replace("spec:\n", "spec:\n  workloadSelector: {labels: {app: db}}\n", 1)
    listeners = generate(types.LISTENER, snapshot(selective), listener_pb2.Listener)
    assert "10.96.0.11_5432" in listeners and "0.0.0.0_7070" in listeners and "10.96.0.11_15432" not in listeners


def test_service_entries_get_their_vip_and_dns_clusters() -> None:
    snap = snapshot()
    clusters = generate(types.CLUSTER, snap, cluster_pb2.Cluster)
    dns = clusters["outbound|8090||echo.external.test"]
    assert dns.type == cluster_pb2.Cluster.STRICT_DNS and dns.dns_lookup_family == cluster_pb2.Cluster.V4_ONLY
    address = dns.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (address.address, address.port_value) == ("localhost", 8090)
    assert clusters["outbound|7000||tcp.external.test"].type == cluster_pb2.Cluster.EDS
    # No auto mTLS outside the mesh (istiod's buildUpstreamTLSSettings): plaintext, no tlsMode match.
    assert not dns.transport_socket_matches and not dns.HasField("transport_socket")
    assert not clusters["outbound|7000||tcp.external.test"].transport_socket_matches
    assert [m.name for m in clusters["outbound|80||web.shop.svc.cluster.local"].transport_socket_matches] == [
        "tlsMode-istio", "tlsMode-disabled"]
    listeners = generate(types.LISTENER, snap, listener_pb2.Listener)
    assert tcp_proxy_of(listeners["10.96.5.1_7000"]).cluster == "outbound|7000||tcp.external.test"
    routes = generate(types.ROUTE, snap, route_pb2.RouteConfiguration)
    host = next(h for h in routes["8090"].virtual_hosts if h.name == "echo.external.test:8090")
    assert list(host.domains) == ["echo.external.test", "echo.external.test.", "10.96.5.2"]


def test_tls_routes_by_sni_with_the_rest_to_the_service() -> None:
    listener = generate(types.LISTENER, snapshot(), listener_pb2.Listener)["10.96.0.14_443"]
    assert [f.name for f in listener.listener_filters] == ["envoy.filters.listener.tls_inspector"]
    by_sni, default = listener.filter_chains
    assert list(by_sni.filter_chain_match.server_names) == ["b.tls.test"]
    assert tcp_proxy_of(listener_pb2.Listener(filter_chains=[by_sni])).cluster == "outbound|443||b.tls.test"
    assert not default.HasField("filter_chain_match")
    assert tcp_proxy_of(listener_pb2.Listener(filter_chains=[default])).cluster == \
        "outbound|443||secure.shop.svc.cluster.local"


def test_a_service_entry_host_without_an_address_takes_its_port_by_sni() -> None:
    for policy, rest in ((OutboundTrafficPolicy.ALLOW_ANY, "PassthroughCluster"),
                         (OutboundTrafficPolicy.REGISTRY_ONLY, "BlackHoleCluster")):
        snap = snapshot(mesh=MeshConfig(outbound_traffic_policy=policy))
        listener = generate(types.LISTENER, snap, listener_pb2.Listener)["0.0.0.0_443"]
        [by_sni], other = listener.filter_chains, listener.default_filter_chain  # the rest: istiod's default chain
        assert list(by_sni.filter_chain_match.server_names) == ["b.tls.test"]
        assert tcp_proxy_of(listener_pb2.Listener(filter_chains=[by_sni])).cluster == "outbound|443||b.tls.test"
        assert tcp_proxy_of(listener_pb2.Listener(filter_chains=[other])).cluster == rest


ENTRIES = """
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: private, namespace: billing}
spec:
  hosts: [private.billing.test]
  addresses: [10.96.5.9]
  ports: [{number: 8090, name: http, protocol: HTTP}, {number: 9100, name: tcp, protocol: TCP}]
  resolution: STATIC
  endpoints: [{address: 127.0.0.41}]
  exportTo: ["."]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: partner, namespace: billing}
spec:
  hosts: [partner.billing.test]
  ports: [{number: 9200, name: grpc, protocol: GRPC}]
  resolution: STATIC
  endpoints: [{address: 127.0.0.42}]
  exportTo: [shop]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: api, namespace: shop}
spec:
  hosts: [api.external.test]
  ports: [{number: 8443, name: http, protocol: HTTP}]
  resolution: DNS
  subjectAltNames: [api.external.test, "spiffe://partner/ns/api/sa/api"]
"""


def test_a_service_entry_is_seen_only_where_it_is_exported() -> None:
    """exportTo `.`: only billing's proxies see private.billing.test; `[shop]`: only shop's (not
    even billing's own) see partner.billing.test; with no exportTo, every namespace."""
    snap = snapshot(ENTRIES)
    shop = generate(types.CLUSTER, snap, cluster_pb2.Cluster)
    assert "outbound|9200||partner.billing.test" in shop and "outbound|7000||tcp.external.test" in shop
    assert not [name for name in shop if "private.billing.test" in name]
    listeners = generate(types.LISTENER, snap, listener_pb2.Listener)
    assert "10.96.5.9_9100" not in listeners and "0.0.0.0_9200" in listeners
    hosts = [h.name for h in generate(types.ROUTE, snap, route_pb2.RouteConfiguration)["8090"].virtual_hosts]
    assert "echo.external.test:8090" in hosts and "private.billing.test:8090" not in hosts

    billing = proxy_from_node("sidecar~127.0.0.32~pay-1.billing~billing.svc.cluster.local", {"LABELS": {"app": "pay"}})
    names = {r.name for r in SIDECAR[types.CLUSTER](snap, billing, None, ResourceCache())}
    assert "outbound|9100||private.billing.test" in names and "outbound|9200||partner.billing.test" not in names
    assert "outbound|7000||tcp.external.test" in names

    # Proxyless gRPC: not in the wildcard, and not served when asked for by name.
    grpc_shop = proxy_from_node(NODE, {"GENERATOR": "grpc"})
    wildcard = {r.name for r in PROXYLESS_GRPC[types.CLUSTER](snap, grpc_shop, None, ResourceCache())}
    assert "outbound|9200||partner.billing.test" in wildcard
    assert not [name for name in wildcard if "private.billing.test" in name]
    asked = ["outbound|8090||private.billing.test", "outbound|9200||partner.billing.test"]
    for type_url in (types.CLUSTER, types.ENDPOINT, types.ROUTE):
        served = {r.name for r in PROXYLESS_GRPC[type_url](snap, grpc_shop, asked, ResourceCache())}
        assert "outbound|8090||private.billing.test" not in served, type_url
    listeners_asked = ["private.billing.test:8090", "partner.billing.test:9200"]
    served = {r.name for r in PROXYLESS_GRPC[types.LISTENER](snap, grpc_shop, listeners_asked, ResourceCache())}
    assert served == {"partner.billing.test:9200"}
    grpc_billing = proxy_from_node("sidecar~127.0.0.32~pay-1.billing~billing.svc.cluster.local", {"GENERATOR": "grpc"})
    served = {r.name for r in PROXYLESS_GRPC[types.LISTENER](snap, grpc_billing, listeners_asked, ResourceCache())}
    assert served == {"private.billing.test:8090"}


def _validation(cluster: cluster_pb2.Cluster) -> list[tuple[int, str]]:
    context = tls_pb2.UpstreamTlsContext()
    cluster.transport_socket.typed_config.Unpack(context)
    validation = context.common_tls_context.validation_context
    return [(m.san_type, m.matcher.exact) for m in validation.match_typed_subject_alt_names]


def test_a_service_entrys_subject_alt_names_are_verified_when_the_rule_names_none() -> None:
    """As istiod: SIMPLE and MUTUAL TLS to a ServiceEntry host check its subjectAltNames unless the
    DestinationRule names its own; auto SAN validation still follows the rule alone."""
    def cluster(tls: str) -> cluster_pb2.Cluster:
        rule = f"""
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {{name: api, namespace: shop}}
spec: {{host: api.external.test, trafficPolicy: {{tls: {tls}}}}}
"""
        return generate(types.CLUSTER, snapshot(ENTRIES, rule), cluster_pb2.Cluster)["outbound|8443||api.external.test"]

    dns, uri = common_pb2.SubjectAltNameMatcher.DNS, common_pb2.SubjectAltNameMatcher.URI
    for tls in ("{mode: SIMPLE}", "{mode: MUTUAL, clientCertificate: /c.pem, privateKey: /k.pem}"):
        assert _validation(cluster(tls)) == [(dns, "api.external.test"), (uri, "api.external.test"),
                                             (dns, "spiffe://partner/ns/api/sa/api"),
                                             (uri, "spiffe://partner/ns/api/sa/api")]
    options = http_options_pb2.HttpProtocolOptions()
    cluster("{mode: SIMPLE}").typed_extension_protocol_options[HTTP_OPTIONS].Unpack(options)
    assert options.upstream_http_protocol_options.auto_san_validation
    assert _validation(cluster("{mode: SIMPLE, subjectAltNames: [other.test]}")) == [
        (dns, "other.test"), (uri, "other.test")]
    assert _validation(cluster("{mode: SIMPLE, insecureSkipVerify: true}")) == []


def test_config_shared_by_proxies_alike_is_each_proxys_own_and_follows_the_snapshot() -> None:
    """One cache for every proxy, as the ADS server has: what proxies of one namespace and labels
    share (istiod/xds/cache.ResourceCache.per_snapshot) never leaks to a proxy that differs, nor
    outlives its snapshot; each gets what a cache of its own would give it."""
    selected = SIDECAR_RESOURCE.replace("spec:\n", "spec:\n  workloadSelector: {labels: {app: web}}\n")
    proxies = [proxy_from_node(NODE, {"LABELS": {"app": "web"}}),
               proxy_from_node("sidecar~127.0.0.33~web-2.shop~shop.svc.cluster.local", {"LABELS": {"app": "web"}}),
               proxy_from_node("sidecar~127.0.0.32~db-1.shop~shop.svc.cluster.local", {"LABELS": {"app": "db"}}),
               proxy_from_node("sidecar~127.0.0.34~x-1.other~other.svc.cluster.local", {"LABELS": {"app": "web"}})]
    shared = ResourceCache()
    for snap in (snapshot(selected), snapshot(), snapshot(selected)):
        for type_url, generator in SIDECAR.items():
            for proxy in proxies:
                for names in (None, [f"outbound|5432||{DB}", "80", "0.0.0.0_80"]):
                    got = {r.name: r.value for r in generator(snap, proxy, names, shared)}
                    own = {r.name: r.value for r in generator(snap, proxy, names, ResourceCache())}
                    assert got == own, (type_url, proxy.id, names)
    web = proxy_from_node(NODE, {"LABELS": {"app": "web"}})
    rpc = "outbound|7070||rpc.shop.svc.cluster.local"
    assert rpc not in {r.name for r in SIDECAR[types.CLUSTER](snap, web, None, shared)}  # the Sidecar narrows web's view...
    db = proxy_from_node("sidecar~127.0.0.32~db-1.shop~shop.svc.cluster.local", {"LABELS": {"app": "db"}})
    assert rpc in {r.name for r in SIDECAR[types.CLUSTER](snap, db, None, shared)}  # ...not db's


def test_results_per_snapshot_are_made_once_per_key_and_snapshot() -> None:
    cache, made = ResourceCache(), []
    first, second = snapshot(), snapshot()

    def build(what: str) -> list[str]:
        made.append(what)
        return [what]

    assert cache.per_snapshot(first, "a", lambda: build("a1")) == ["a1"]
    assert cache.per_snapshot(first, "a", lambda: build("a2")) == ["a1"]
    assert cache.per_snapshot(first, "b", lambda: build("b1")) == ["b1"]
    assert cache.per_snapshot(second, "a", lambda: build("a3")) == ["a3"]
    assert made == ["a1", "b1", "a3"]

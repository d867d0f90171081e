"""DestinationRule cluster settings, translated as istiod's cluster builder does: consistent hash
(ring hash, maglev, cookie attributes), warmup, the connection pool's keepalive, timeouts and
protocol, PROXY protocol and the CRL, for sidecars, gateways and proxyless gRPC. Pure translation;
tests/test_envoy_cluster_policy.py shows a real Envoy doing it."""

from __future__ import annotations

import base64
import dataclasses
from pathlib import Path
from typing import Any

import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.transport_sockets.proxy_protocol.v3 import upstream_proxy_protocol_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2, tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2

from istiod.model.builder import build_snapshot
from istiod.model.proxy import proxy_from_node
from istiod.model.snapshot import Snapshot
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import PROXYLESS_GRPC, ROUTER, SIDECAR
from tests.test_gateway_gen import server_credential, tls_secret

DATA = Path(__file__).parent / "data"
WEB = "web.shop.svc.cluster.local"
RPC = "rpc.shop.svc.cluster.local"
SIDECAR_NODE = "sidecar~127.0.0.31~web-1.shop~shop.svc.cluster.local"
GATEWAY_NODE = "router~127.0.0.41~gw-1.shop~shop.svc.cluster.local"
GRPC_NODE = "sidecar~127.0.0.51~rpc-client.shop~shop.svc.cluster.local"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _snapshot(*rules: dict[str, Any]) -> Snapshot:
    store = Store()
    for document in yaml.safe_load_all((DATA / "sidecar-mesh.yaml").read_text()):
        store.apply(document)
    for i, spec in enumerate(rules):
        store.apply({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
                     "metadata": {"name": f"r{i}", "namespace": "shop"}, "spec": spec})
    return build_snapshot(store, "v1")


def _clusters(snapshot: Snapshot, node: str = SIDECAR_NODE, generators: Any = SIDECAR,
              labels: dict[str, str] | None = None) -> dict[str, cluster_pb2.Cluster]:
    proxy = proxy_from_node(node, {"LABELS": labels} if labels else {})
    resources = generators[types.CLUSTER](snapshot, proxy, None, ResourceCache())
    return {r.name: cluster_pb2.Cluster.FromString(r.value) for r in resources}


def _web(policy: dict[str, Any], node: str = SIDECAR_NODE, generators: Any = SIDECAR) -> cluster_pb2.Cluster:
    return _clusters(_snapshot({"host": "web", "trafficPolicy": policy}), node, generators)[f"outbound|80||{WEB}"]


def _http_options(cluster: cluster_pb2.Cluster) -> http_protocol_options_pb2.HttpProtocolOptions:
    return http_protocol_options_pb2.HttpProtocolOptions.FromString(
        cluster.typed_extension_protocol_options[HTTP_OPTIONS].value)


def test_ring_hash_and_maglev_with_their_sizes_on_sidecars_and_gateways() -> None:
    for node, generators in ((SIDECAR_NODE, SIDECAR), (GATEWAY_NODE, ROUTER)):
        ring = _web({"loadBalancer": {"consistentHash": {"httpHeaderName": "x-user", "ringHash": {"minimumRingSize": 64}}}},
                    node, generators)
        assert ring.lb_policy == cluster_pb2.Cluster.RING_HASH and ring.ring_hash_lb_config.minimum_ring_size.value == 64
        maglev = _web({"loadBalancer": {"consistentHash": {"httpHeaderName": "x", "maglev": {"tableSize": 65537}}}},
                      node, generators)
        assert maglev.lb_policy == cluster_pb2.Cluster.MAGLEV and maglev.maglev_lb_config.table_size.value == 65537
    # The deprecated form: Envoy's 1024 written out when unset, as istiod.
    old = _web({"loadBalancer": {"consistentHash": {"useSourceIp": True}}})
    assert old.lb_policy == cluster_pb2.Cluster.RING_HASH and old.ring_hash_lb_config.minimum_ring_size.value == 1024
    assert _web({"loadBalancer": {"consistentHash": {"useSourceIp": True, "minimumRingSize": 8}}}) \
        .ring_hash_lb_config.minimum_ring_size.value == 8
    bare = _web({"loadBalancer": {"consistentHash": {"useSourceIp": True, "ringHash": {}}}})
    assert bare.lb_policy == cluster_pb2.Cluster.RING_HASH and not bare.HasField("ring_hash_lb_config")


def test_proxyless_grpc_takes_ring_hash_for_maglev() -> None:
    snapshot = _snapshot({"host": "rpc", "trafficPolicy": {"loadBalancer": {
        "consistentHash": {"httpHeaderName": "x-user", "maglev": {"tableSize": 65537}}}}})
    clusters = _clusters(snapshot, GRPC_NODE, PROXYLESS_GRPC)
    rpc = clusters[f"outbound|7070||{RPC}"]
    assert rpc.lb_policy == cluster_pb2.Cluster.RING_HASH and not rpc.HasField("maglev_lb_config")


def test_cookie_hash_policy_carries_its_attributes() -> None:
    snapshot = _snapshot({"host": "web", "trafficPolicy": {"loadBalancer": {"consistentHash": {"httpCookie": {
        "name": "session", "path": "/", "ttl": "60s",
        "attributes": [{"name": "SameSite", "value": "Strict"}, {"name": "Secure"}]}}}}})
    proxy = proxy_from_node(SIDECAR_NODE, {})
    routes = [route_pb2.RouteConfiguration.FromString(r.value)
              for r in SIDECAR[types.ROUTE](snapshot, proxy, ["80"], ResourceCache())]
    (policy,) = [h for r in routes for v in r.virtual_hosts if WEB in v.domains
                 for route in v.routes for h in route.route.hash_policy]
    cookie = policy.cookie
    assert (cookie.name, cookie.path, cookie.ttl.seconds) == ("session", "/", 60)
    assert [(a.name, a.value) for a in cookie.attributes] == [("SameSite", "Strict"), ("Secure", "")]


def test_warmup_is_slow_start_on_round_robin_and_least_request() -> None:
    warmup = {"duration": "30s", "aggression": 2.0, "minimumPercent": 20}
    rr = _web({"loadBalancer": {"simple": "ROUND_ROBIN", "warmup": warmup}})
    start = rr.round_robin_lb_config.slow_start_config
    assert rr.lb_policy == cluster_pb2.Cluster.ROUND_ROBIN
    assert (start.slow_start_window.seconds, start.aggression.default_value, start.aggression.runtime_key,
            start.min_weight_percent.value) == (30, 2.0, "(", 20.0)
    # No `simple`: the sidecar's default, LEAST_REQUEST; aggression 1 and 10% unless set, as istiod.
    default = _web({"loadBalancer": {"warmup": {"duration": "5s"}}})
    start = default.least_request_lb_config.slow_start_config
    assert default.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST
    assert (start.slow_start_window.seconds, start.aggression.default_value, start.min_weight_percent.value) == (5, 1.0, 10.0)
    # The deprecated warmupDurationSecs sets the window alone.
    old = _web({"loadBalancer": {"simple": "ROUND_ROBIN", "warmupDurationSecs": "15s"}}).round_robin_lb_config
    assert old.slow_start_config.slow_start_window.seconds == 15 and not old.slow_start_config.HasField("aggression")
    least = _web({"loadBalancer": {"simple": "LEAST_REQUEST", "warmup": warmup}})
    config = least_request_pb2.LeastRequest.FromString(
        least.load_balancing_policy.policies[0].typed_extension_config.typed_config.value)
    assert config.slow_start_config.slow_start_window.seconds == 30
    # RANDOM has no slow start.
    random = _web({"loadBalancer": {"simple": "RANDOM", "warmup": warmup}})
    assert not random.HasField("round_robin_lb_config") and not random.HasField("least_request_lb_config")


def test_connection_pool_keepalive_timeouts_and_protocol() -> None:
    cluster = _web({"connectionPool": {
        "tcp": {"tcpKeepalive": {"probes": 3, "time": "7200s", "interval": "75s"}, "maxConnectionDuration": "1h",
                "idleTimeout": "30s"},
        "http": {"maxRequestsPerConnection": 5}}})
    keepalive = cluster.upstream_connection_options.tcp_keepalive
    assert (keepalive.keepalive_probes.value, keepalive.keepalive_time.value, keepalive.keepalive_interval.value) == (
        3, 7200, 75)
    options = _http_options(cluster)
    common = options.common_http_protocol_options
    assert (common.idle_timeout.seconds, common.max_connection_duration.seconds,
            common.max_requests_per_connection.value) == (30, 3600, 5)
    assert options.explicit_http_config.HasField("http_protocol_options")
    # The HTTP idle timeout wins over the TCP one; an empty keepalive is SO_KEEPALIVE with the OS's values.
    cluster = _web({"connectionPool": {"tcp": {"idleTimeout": "30s", "tcpKeepalive": {}},
                                       "http": {"idleTimeout": "5s"}}})
    assert _http_options(cluster).common_http_protocol_options.idle_timeout.seconds == 5
    assert cluster.upstream_connection_options.HasField("tcp_keepalive")


def test_h2_upgrade_and_client_protocol() -> None:
    upgraded = _http_options(_web({"connectionPool": {"http": {"h2UpgradePolicy": "UPGRADE", "maxConcurrentStreams": 9}}}))
    assert upgraded.explicit_http_config.http2_protocol_options.max_concurrent_streams.value == 9
    assert HTTP_OPTIONS not in _web({"connectionPool": {"http": {"h2UpgradePolicy": "DO_NOT_UPGRADE"}}}) \
        .typed_extension_protocol_options
    client = _http_options(_web({"connectionPool": {"http": {"useClientProtocol": True, "h2UpgradePolicy": "UPGRADE"}}}))
    assert client.WhichOneof("upstream_protocol_options") == "use_downstream_protocol_config"
    assert client.use_downstream_protocol_config.HasField("http2_protocol_options")


def test_proxy_protocol_wraps_every_transport_socket() -> None:
    auto = _web({"proxyProtocol": {"version": "V2"}})
    for match in auto.transport_socket_matches:
        assert match.transport_socket.name == "envoy.transport_sockets.upstream_proxy_protocol"
        wrapper = upstream_proxy_protocol_pb2.ProxyProtocolUpstreamTransport.FromString(
            match.transport_socket.typed_config.value)
        assert wrapper.config.version == wrapper.config.V2
    assert [upstream_proxy_protocol_pb2.ProxyProtocolUpstreamTransport.FromString(
        m.transport_socket.typed_config.value).transport_socket.name for m in auto.transport_socket_matches] == [
        "envoy.transport_sockets.tls", "envoy.transport_sockets.raw_buffer"]
    plain = _web({"proxyProtocol": {}, "tls": {"mode": "DISABLE"}})
    wrapper = upstream_proxy_protocol_pb2.ProxyProtocolUpstreamTransport.FromString(plain.transport_socket.typed_config.value)
    assert wrapper.config.version == wrapper.config.V1 and wrapper.transport_socket.name == "envoy.transport_sockets.raw_buffer"
    # A subset's own setting wins.
    snapshot = _snapshot({"host": "web", "trafficPolicy": {"proxyProtocol": {"version": "V1"}, "tls": {"mode": "DISABLE"}},
                          "subsets": [{"name": "v2", "labels": {"app": "web"},
                                       "trafficPolicy": {"proxyProtocol": {"version": "V2"}}}]})
    v2 = _clusters(snapshot)[f"outbound|80|v2|{WEB}"]
    wrapper = upstream_proxy_protocol_pb2.ProxyProtocolUpstreamTransport.FromString(v2.transport_socket.typed_config.value)
    assert wrapper.config.version == wrapper.config.V2


def test_ca_crl_is_the_validation_contexts_crl() -> None:
    cluster = _web({"tls": {"mode": "SIMPLE", "caCertificates": "/etc/ca.pem", "caCrl": "/etc/ca.crl"}})
    context = tls_pb2.UpstreamTlsContext.FromString(cluster.transport_socket.typed_config.value)
    validation = context.common_tls_context.validation_context
    assert (validation.trusted_ca.filename, validation.crl.filename) == ("/etc/ca.pem", "/etc/ca.crl")


def test_port_level_settings_replace_the_policy_wholesale() -> None:
    """As istiod's GetPortLevelTrafficPolicy: what the port's entry leaves out is the default, not
    the destination-level value (PROXY protocol included); a subset's fields still win one by one."""
    snapshot = _snapshot({"host": "db", "trafficPolicy": {
        "connectionPool": {"tcp": {"tcpKeepalive": {"probes": 3}}}, "proxyProtocol": {"version": "V2"},
        "portLevelSettings": [{"port": {"number": 5432}, "loadBalancer": {"simple": "ROUND_ROBIN"}}]},
        "subsets": [{"name": "v1", "labels": {"app": "db"}, "trafficPolicy": {"outlierDetection": {"interval": "5s"}}}]})
    clusters = _clusters(snapshot)
    for name in ("outbound|5432||db.shop.svc.cluster.local", "outbound|5432|v1|db.shop.svc.cluster.local"):
        db = clusters[name]
        assert db.lb_policy == cluster_pb2.Cluster.ROUND_ROBIN
        assert not db.HasField("upstream_connection_options")
        assert all(m.transport_socket.name != "envoy.transport_sockets.upstream_proxy_protocol"
                   for m in db.transport_socket_matches)
    assert clusters["outbound|5432|v1|db.shop.svc.cluster.local"].outlier_detection.interval.seconds == 5


def test_a_retry_budget_is_the_circuit_breakers_own_a_subsets_wins_and_a_port_level_entry_drops_it() -> None:
    """Istio's trafficPolicy.retryBudget: istiod's defaults (20%, 3 retries at once), its interval as
    Envoy's budget_interval; a subset's own wins (istiod's MergeTrafficPolicy); a port's entry replaces
    the policy without one; proxyless gRPC is sent none."""
    snapshot = _snapshot({"host": "web", "trafficPolicy": {"retryBudget": {"budgetInterval": "5s"}},
                          "subsets": [{"name": "v1", "labels": {"app": "web"},
                                       "trafficPolicy": {"retryBudget": {"percent": 33.5, "minRetryConcurrency": 7}}}]},
                         {"host": "db", "trafficPolicy": {"retryBudget": {"percent": 10},
                                                          "portLevelSettings": [{"port": {"number": 5432},
                                                                                 "loadBalancer": {"simple": "RANDOM"}}]}})
    clusters = _clusters(snapshot)
    budget = clusters[f"outbound|80||{WEB}"].circuit_breakers.thresholds[0].retry_budget
    assert (budget.budget_percent.value, budget.min_retry_concurrency.value) == (20.0, 3)
    assert budget.SerializeToString().endswith(bytes([0x1a, 2, 8, 5]))  # budget_interval: 5 s
    subset = clusters[f"outbound|80|v1|{WEB}"].circuit_breakers.thresholds[0].retry_budget
    assert (subset.budget_percent.value, subset.min_retry_concurrency.value) == (33.5, 7)
    db = clusters["outbound|5432||db.shop.svc.cluster.local"]
    assert not db.circuit_breakers.thresholds[0].HasField("retry_budget")
    grpc = _clusters(_snapshot({"host": "rpc", "trafficPolicy": {"retryBudget": {"percent": 10}}}), GRPC_NODE,
                     PROXYLESS_GRPC)
    assert all(not t.HasField("retry_budget") for c in grpc.values() for t in c.circuit_breakers.thresholds)


def test_credential_name_is_served_over_sds_from_the_proxys_namespace() -> None:
    """A DestinationRule's credentialName, as istiod: the cluster asks over ADS for
    `kubernetes://<name>` (MUTUAL's client certificate) and `kubernetes://<name>-cacert` (the CA);
    a verified sidecar gets them from the Secret of its own namespace, never another's."""
    ca, cert, key = server_credential("client.example.com")
    store = Store()
    for document in yaml.safe_load_all((DATA / "sidecar-mesh.yaml").read_text()):
        store.apply(document)
    secret = tls_secret("client-cred", "shop", cert, key)
    secret["data"]["ca.crt"] = base64.b64encode(ca).decode()
    store.apply(secret)
    store.apply({**tls_secret("client-cred", "other", cert, key)})
    spec: dict[str, Any] = {"host": "web", "trafficPolicy": {"tls": {
        "mode": "MUTUAL", "credentialName": "client-cred", "subjectAltNames": ["web.example.com"]}}}
    rule = {"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
            "metadata": {"name": "web", "namespace": "shop"}, "spec": spec}
    store.apply(rule)
    # Without a workloadSelector istiod gives a sidecar no TLS for it (a gateway gets it).
    plain = _clusters(build_snapshot(store, "v0"))[f"outbound|80||{WEB}"]
    assert plain.transport_socket.name == "envoy.transport_sockets.raw_buffer" and not plain.transport_socket_matches
    gateway = _clusters(build_snapshot(store, "v0"), GATEWAY_NODE, ROUTER)[f"outbound|80||{WEB}"]
    assert gateway.transport_socket.name == "envoy.transport_sockets.tls"
    store.apply({**rule, "spec": {**spec, "workloadSelector": {"matchLabels": {"app": "web"}}}})
    snapshot = build_snapshot(store, "v1")
    web = _clusters(snapshot, labels={"app": "web"})[f"outbound|80||{WEB}"]
    common = tls_pb2.UpstreamTlsContext.FromString(web.transport_socket.typed_config.value).common_tls_context
    assert [(c.name, c.sds_config.HasField("ads")) for c in common.tls_certificate_sds_secret_configs] == [
        ("kubernetes://client-cred", True)]
    combined = common.combined_validation_context
    assert combined.validation_context_sds_secret_config.name == "kubernetes://client-cred-cacert"
    assert {m.matcher.exact for m in combined.default_validation_context.match_typed_subject_alt_names} == {
        "web.example.com"}

    names = ["kubernetes://client-cred", "kubernetes://client-cred-cacert"]
    proxy = dataclasses.replace(proxy_from_node(SIDECAR_NODE, {}), verified=True)
    secrets = {r.name: secret_pb2.Secret.FromString(r.value)
               for r in SIDECAR[types.SECRET](snapshot, proxy, names, ResourceCache())}
    assert secrets["kubernetes://client-cred"].tls_certificate.private_key.inline_bytes == key
    assert secrets["kubernetes://client-cred-cacert"].validation_context.trusted_ca.inline_bytes == ca
    # Another namespace's proxy: its own namespace's Secret, which has no CA. (Nothing goes to an
    # unverified proxy: tests/test_gateway_gen.py.)
    other = dataclasses.replace(proxy_from_node("sidecar~127.0.0.32~web-2.other~other.svc.cluster.local", {}),
                                verified=True)
    assert [r.name for r in SIDECAR[types.SECRET](snapshot, other, names, ResourceCache())] == [
        "kubernetes://client-cred"]


def test_an_h2_upgraded_cluster_offers_h2_in_the_tls_it_originates() -> None:
    cluster = _web({"connectionPool": {"http": {"h2UpgradePolicy": "UPGRADE"}}, "tls": {"mode": "SIMPLE"}})
    context = tls_pb2.UpstreamTlsContext.FromString(cluster.transport_socket.typed_config.value)
    assert list(context.common_tls_context.alpn_protocols) == ["h2"]
    plain = _web({"tls": {"mode": "SIMPLE"}})
    assert not tls_pb2.UpstreamTlsContext.FromString(plain.transport_socket.typed_config.value) \
        .common_tls_context.alpn_protocols

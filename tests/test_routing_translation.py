"""VirtualService and DestinationRule translation on the data fixture: model in, protos out.
(tests/test_proxyless_routing.py proves the behaviour with real gRPC clients.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.fault.v3 import fault_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.type.v3 import percent_pb2

from istiod.model.builder import build_snapshot
from istiod.model.mesh import MeshConfig
from istiod.model.proxy import proxy_from_node
from istiod.model.snapshot import Snapshot
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import PROXYLESS_GRPC

DATA = Path(__file__).parent / "data"
HOST = "reviews.demo.svc.cluster.local"
ROUTE_NAME = f"outbound|9080||{HOST}"
CLIENT = "sidecar~10.0.9.9~productpage-1.demo~demo.svc.cluster.local"
MILLION = percent_pb2.FractionalPercent.MILLION


def _snapshot(mesh: MeshConfig = MeshConfig()) -> Snapshot:
    store = Store()
    for document in yaml.safe_load_all((DATA / "routing-mesh.yaml").read_text()):
        store.apply(document)
    return build_snapshot(store, "v1", mesh=mesh)


def _generate(type_url: str, names: list[str] | None, message: Any, labels: dict[str, str] | None = None,
              mesh: MeshConfig = MeshConfig()) -> dict[str, Any]:
    proxy = proxy_from_node(CLIENT, {"LABELS": labels or {}, "GENERATOR": "grpc"})
    resources = PROXYLESS_GRPC[type_url](_snapshot(mesh), proxy, names, ResourceCache())
    return {r.name: message.FromString(r.value) for r in resources}


def test_listener_points_at_istiods_route_name_with_fault_before_router() -> None:
    listener = _generate(types.LISTENER, ["reviews.demo:9080"], listener_pb2.Listener)["reviews.demo:9080"]
    manager = hcm_pb2.HttpConnectionManager()
    listener.api_listener.api_listener.Unpack(manager)
    assert manager.rds.route_config_name == ROUTE_NAME
    assert [f.name for f in manager.http_filters] == ["envoy.filters.http.fault", "envoy.filters.http.router"]


def test_virtual_service_routes() -> None:
    config = _generate(types.ROUTE, [ROUTE_NAME], route_pb2.RouteConfiguration)[ROUTE_NAME]
    routes = config.virtual_hosts[0].routes
    # The sourceLabels match applies to productpage only: another client has one route fewer.
    assert [r.name for r in routes] == ["canary.by-user", "no-retries", ""]
    canary = routes[0]
    assert canary.match.prefix == "/reviews.Reviews/"
    headers = {(h.name, h.string_match.exact or h.string_match.prefix, h.invert_match) for h in canary.match.headers}
    assert headers == {("x-user", "jason", False), ("x-debug", "1", True)}
    action = canary.route
    assert [(c.name, c.weight.value) for c in action.weighted_clusters.clusters] == [
        (f"outbound|9080|v2|{HOST}", 90), (f"outbound|9080|v1|{HOST}", 10)]
    assert action.max_stream_duration.max_stream_duration.ToMilliseconds() == 1500
    assert action.timeout.ToMilliseconds() == 1500
    retry = action.retry_policy
    assert (retry.retry_on, retry.num_retries.value, list(retry.retriable_status_codes),
            retry.per_try_timeout.ToMilliseconds()) == (
        "unavailable,resource-exhausted,retriable-status-codes", 3, [503], 250)
    fault = fault_pb2.HTTPFault()
    canary.typed_per_filter_config["envoy.filters.http.fault"].Unpack(fault)
    assert (fault.delay.fixed_delay.ToMilliseconds(), fault.delay.percentage.numerator,
            fault.delay.percentage.denominator) == (100, 500000, MILLION)
    assert (fault.abort.grpc_status, fault.abort.percentage.numerator) == (14, 1000)

    put = routes[1]
    assert put.match.path == "/reviews.Reviews/Put"
    assert put.route.cluster == "outbound|9090||ratings.demo.svc.cluster.local"
    assert not put.route.HasField("retry_policy")  # attempts: 0
    # The catch-all: one destination, istiod's default retries, no timeout.
    last = routes[2]
    assert (last.match.prefix, last.route.cluster) == ("/", f"outbound|9080|v2|{HOST}")
    assert last.route.retry_policy.retry_on == "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes"
    assert last.route.retry_policy.num_retries.value == 2
    assert last.route.max_stream_duration.max_stream_duration.ToNanoseconds() == 0
    # consistentHash applies to a single destination's route (subset v2 keeps the rule's; v1 overrides it).
    assert [h.header.header_name for h in last.route.hash_policy] == ["x-user"]

    productpage = _generate(types.ROUTE, [ROUTE_NAME], route_pb2.RouteConfiguration,
                            labels={"app": "productpage"})[ROUTE_NAME]
    canary = productpage.virtual_hosts[0].routes[:2]
    assert [r.name for r in canary] == ["canary.by-user", "canary"]
    assert canary[1].match.safe_regex.regex == "/reviews\\.Reviews/Get.*"


def test_default_route_without_a_virtual_service() -> None:
    name = "outbound|9090||ratings.demo.svc.cluster.local"
    route = _generate(types.ROUTE, [name], route_pb2.RouteConfiguration)[name].virtual_hosts[0].routes
    assert [(r.name, r.match.prefix, r.route.cluster, r.route.retry_policy.num_retries.value) for r in route] == [
        ("default", "/", name, 2)]


def test_destination_rule_clusters() -> None:
    names = [f"outbound|9080||{HOST}", f"outbound|9080|v1|{HOST}", f"outbound|9080|v2|{HOST}",
             f"outbound|9080|v3|{HOST}"]
    clusters = _generate(types.CLUSTER, names, cluster_pb2.Cluster, mesh=MeshConfig(mtls=True))
    assert sorted(clusters) == sorted(names[:3])  # no rule defines v3
    main = clusters[names[0]]
    assert main.lb_policy == cluster_pb2.Cluster.RING_HASH
    assert main.ring_hash_lb_config.minimum_ring_size.value == 1024
    threshold = main.circuit_breakers.thresholds[0]
    assert (threshold.max_requests.value, threshold.max_pending_requests.value, threshold.max_retries.value) == (7, 3, 4)
    assert main.connect_timeout.seconds == 2
    outlier = main.outlier_detection
    assert (outlier.consecutive_5xx.value, outlier.enforcing_consecutive_5xx.value, outlier.interval.seconds,
            outlier.base_ejection_time.seconds, outlier.max_ejection_percent.value) == (5, 100, 10, 30, 50)
    assert outlier.HasField("enforcing_success_rate") and outlier.enforcing_success_rate.value == 0
    assert main.common_lb_config.healthy_panic_threshold.value == 20
    assert main.HasField("transport_socket")  # mesh mTLS, no TLS setting

    v1 = clusters[names[1]]
    assert [p.typed_extension_config.name for p in v1.load_balancing_policy.policies] == [
        "envoy.load_balancing_policies.least_request", "envoy.load_balancing_policies.round_robin"]
    assert not v1.HasField("transport_socket")  # tls DISABLE
    assert v1.circuit_breakers.thresholds[0].max_requests.value == 7  # inherited from the rule
    v2 = clusters[names[2]]
    assert v2.HasField("transport_socket") and v2.lb_policy == cluster_pb2.Cluster.RING_HASH
    # ISTIO_MUTUAL names the subset's identities only.
    tls = v2.transport_socket.typed_config.value
    assert b"sa/reviews-v2" in tls and b"sa/reviews\x12" not in tls


def test_subset_endpoints_and_unready_left_out() -> None:
    names = [f"outbound|9080||{HOST}", f"outbound|9080|v1|{HOST}", f"outbound|9080|v2|{HOST}"]
    assignments = _generate(types.ENDPOINT, names, endpoint_pb2.ClusterLoadAssignment)

    def addresses(name: str) -> list[str]:
        return [e.endpoint.address.socket_address.address
                for group in assignments[name].endpoints for e in group.lb_endpoints]

    assert addresses(names[0]) == ["10.0.0.1", "10.0.0.2"]  # 10.0.0.3 is not ready
    assert addresses(names[1]) == ["10.0.0.1"]
    assert addresses(names[2]) == ["10.0.0.2"]


def test_wildcard_clusters_include_subsets() -> None:
    assert set(_generate(types.CLUSTER, None, cluster_pb2.Cluster)) == {
        f"outbound|9080||{HOST}", f"outbound|9080|v1|{HOST}", f"outbound|9080|v2|{HOST}",
        "outbound|9090||ratings.demo.svc.cluster.local", "outbound|443||api.example.com",
        # NONE and wildcard hosts are services too (EDS for a proxyless client, as istiod builds any it names).
        "outbound|80||none.example.com", "outbound|443||*.wild.example.com"}


def test_service_entry_hosts() -> None:
    snapshot = _snapshot()
    assert "api.example.com" in snapshot.services
    assert {"none.example.com", "*.wild.example.com"} <= set(snapshot.services)  # NONE, wildcard
    name = "outbound|443||api.example.com"
    cluster = _generate(types.CLUSTER, [name], cluster_pb2.Cluster, mesh=MeshConfig(mtls=True))[name]
    assert cluster.type == cluster_pb2.Cluster.LOGICAL_DNS
    assert not cluster.HasField("transport_socket")  # mesh mTLS is not for external hosts
    [endpoint] = cluster.load_assignment.endpoints[0].lb_endpoints
    address = endpoint.endpoint.address.socket_address
    assert (address.address, address.port_value) == ("api.example.com", 8443)
    assert _generate(types.ENDPOINT, [name], endpoint_pb2.ClusterLoadAssignment) == {}
    listeners = _generate(types.LISTENER, ["api.example.com:443"], listener_pb2.Listener)
    assert list(listeners) == ["api.example.com:443"]


def test_routes_and_clusters_are_cached_across_snapshots_until_their_inputs_change() -> None:
    store = Store()
    for document in yaml.safe_load_all((DATA / "routing-mesh.yaml").read_text()):
        store.apply(document)
    proxy = proxy_from_node(CLIENT, {"GENERATOR": "grpc"})
    cache = ResourceCache()
    names = [ROUTE_NAME, f"outbound|9080|v2|{HOST}"]

    snapshots: list[Snapshot] = []
    changed: list[ObjectKey] = []
    store.subscribe(lambda change: changed.append(change.key))

    def generate(version: str) -> list[Any]:
        # As the server builds them: from the previous one and what changed since, the rest carried over.
        snapshot = build_snapshot(store, version, previous=snapshots[-1] if snapshots else None, changed=list(changed))
        snapshots.append(snapshot)
        changed.clear()
        return [*PROXYLESS_GRPC[types.ROUTE](snapshot, proxy, names[:1], cache),
                *PROXYLESS_GRPC[types.CLUSTER](snapshot, proxy, names[1:], cache)]

    first = generate("v1")
    assert all(a is b for a, b in zip(first, generate("v2"), strict=True))  # nothing changed: cache hits
    rule = next(d for d in yaml.safe_load_all((DATA / "routing-mesh.yaml").read_text())
                if d["kind"] == "DestinationRule")
    rule["spec"]["trafficPolicy"]["loadBalancer"] = {"simple": "ROUND_ROBIN"}
    store.apply(rule)
    route, cluster = generate("v3")
    assert route is not first[0] and cluster is not first[1]
    config = route_pb2.RouteConfiguration.FromString(route.value)
    assert not config.virtual_hosts[0].routes[-1].route.hash_policy  # the rule's consistentHash is gone


def test_bare_name_only_from_the_services_namespace() -> None:
    assert list(_generate(types.LISTENER, ["reviews:9080"], listener_pb2.Listener)) == ["reviews:9080"]
    config = _generate(types.ROUTE, [ROUTE_NAME], route_pb2.RouteConfiguration)[ROUTE_NAME]
    assert {"reviews", "reviews:9080"} <= set(config.virtual_hosts[0].domains)
    other = proxy_from_node("sidecar~10.0.9.8~client.other~other.svc.cluster.local", {"GENERATOR": "grpc"})
    assert PROXYLESS_GRPC[types.LISTENER](_snapshot(), other, ["reviews:9080"], ResourceCache()) == []

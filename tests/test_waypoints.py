"""Waypoints: the `istio-waypoint` class and its Gateways' status, and the waypoint ztunnel is told
of in WDS (Service.waypoint, Workload.waypoint), as istiod's ambient index picks it."""

from __future__ import annotations

import copy
import json
from typing import Any

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from google.protobuf import json_format

from istiod.gen.istio.workload import workload_pb2 as wpb
from istiod.model.builder import build_snapshot
from istiod.model.proxy import proxy_from_node
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Store
from istiod.xds.cache import ResourceCache
from istiod.xds import types
from istiod.xds.gen import generators_for
from istiod.xds.gen.security import authorization_policies
from istiod.xds.gen.ztunnel import addresses
from tests.test_ztunnel_gen import NODE, _serve, _store, _Stream

ECHO = "ambient/echo.ambient.svc.cluster.local"
ECHO_POD = "Kubernetes//Pod/ambient/echo-1"
WAYPOINT = {"hostname": {"namespace": "ambient", "hostname": "waypoint.ambient.svc.cluster.local"},
            "hboneMtlsPort": 15008}


def _found(store: Store) -> dict[str, dict[str, Any]]:
    snapshot = build_snapshot(store, "v1")
    return {r.name: json_format.MessageToDict(wpb.Address.FromString(r.value))
            for r in addresses(snapshot, proxy_from_node(NODE, {}), None, ResourceCache())}


def _edit(store: Store, kind: str, namespace: str, name: str, change: Any) -> None:
    raw = copy.deepcopy(store.get(ObjectKey(kind, namespace, name)).raw)  # type: ignore[union-attr]
    change(raw)
    store.apply(raw)


def _set(labels: dict[str, str]) -> Any:
    def change(raw: dict[str, Any]) -> None:
        current = raw["metadata"].setdefault("labels", {})
        current.update(labels)
        for key in [k for k, v in current.items() if v == ""]:
            del current[key]
    return change


def _waypoint_for(value: str) -> Any:
    return _set({"istio.io/waypoint-for": value})


def test_the_waypoint_class_is_accepted_and_its_gateway_programmed_with_its_hostname() -> None:
    snapshot = build_snapshot(_store(), "v1")
    statuses = snapshot.config.gateway_api.statuses
    [accepted] = statuses[("GatewayClass", "", "istio-waypoint")]["conditions"]
    assert (accepted["type"], accepted["status"], accepted["reason"]) == ("Accepted", "True", "Accepted")
    gateway = statuses[("KubernetesGateway", "ambient", "waypoint")]
    conditions = {c["type"]: (c["status"], c["reason"], c["message"]) for c in gateway["conditions"]}
    assert conditions["Accepted"][:2] == ("True", "Accepted")
    assert conditions["Programmed"] == ("True", "Programmed", "Resource programmed, assigned to service(s) "
                                        "waypoint.ambient.svc.cluster.local:15008")
    # Both, as istiod's waypoint class reports them; ztunnel is pointed at the hostname.
    assert gateway["addresses"] == [{"type": "IPAddress", "value": "10.96.1.2"},
                                    {"type": "Hostname", "value": "waypoint.ambient.svc.cluster.local"}]
    [listener] = gateway["listeners"]
    assert listener["name"] == "mesh" and listener["supportedKinds"] == [] and listener["attachedRoutes"] == 0
    assert all(c["status"] == ("False" if c["type"] == "Conflicted" else "True") for c in listener["conditions"])
    # A waypoint makes no Istio Gateway (its proxy is no gateway flavor).
    assert not any(g.meta.name.startswith("waypoint") for g in snapshot.config.gateway_api.gateways)


def test_a_waypoint_listener_other_than_hbone_on_15008_is_not_accepted() -> None:
    store = _store()
    _edit(store, "KubernetesGateway", "ambient", "waypoint",
          lambda raw: raw["spec"]["listeners"].append({"name": "http", "port": 80, "protocol": "HTTP"}))
    gateway = build_snapshot(store, "v1").config.gateway_api.statuses[("KubernetesGateway", "ambient", "waypoint")]
    http = next(entry for entry in gateway["listeners"] if entry["name"] == "http")
    accepted = next(c for c in http["conditions"] if c["type"] == "Accepted")
    assert (accepted["status"], accepted["reason"], accepted["message"]) == (
        "False", "UnsupportedProtocol", 'Expected a single listener on port 15008 with protocol "HBONE"')
    # Only said, as istiod does: the listener stays Programmed and the Gateway Accepted.
    assert next(c for c in http["conditions"] if c["type"] == "Programmed")["status"] == "True"
    assert next(c for c in gateway["conditions"] if c["type"] == "Accepted")["reason"] == "Accepted"


def test_a_route_with_a_waypoint_gateway_parent_is_refused_by_the_mesh_controller() -> None:
    store = _store()
    store.apply({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                 "metadata": {"name": "via-waypoint", "namespace": "ambient"},
                 "spec": {"parentRefs": [{"name": "waypoint"}], "rules": [{"backendRefs": [{"name": "echo", "port": 80}]}]}})
    statuses = build_snapshot(store, "v1").config.gateway_api.statuses
    [parent] = statuses[("HTTPRoute", "ambient", "via-waypoint")]["parents"]
    assert parent["controllerName"] == "istio.io/mesh-controller"
    accepted = next(c for c in parent["conditions"] if c["type"] == "Accepted")
    assert (accepted["status"], accepted["reason"]) == ("False", "UnsupportedValue")
    assert "waypoint" in accepted["message"]


def test_a_service_of_the_namespace_gets_its_waypoint_and_workloads_only_when_it_takes_them() -> None:
    found = _found(_store())
    assert found[ECHO]["service"]["waypoint"] == WAYPOINT
    assert "waypoint" not in found[ECHO_POD]["workload"]  # a `service` waypoint
    assert "waypoint" not in found["Kubernetes//Pod/ambient/waypoint-1"]["workload"]  # never its own
    for traffic, service, workload in (("workload", False, True), ("all", True, True), ("none", False, False)):
        store = _store()
        _edit(store, "KubernetesGateway", "ambient", "waypoint", _waypoint_for(traffic))
        found = _found(store)
        assert ("waypoint" in found[ECHO]["service"], "waypoint" in found[ECHO_POD]["workload"]) == (service, workload)
    # No label on the Gateway: its class's, else `service`.
    store = _store()
    _edit(store, "KubernetesGateway", "ambient", "waypoint", _waypoint_for(""))
    _edit(store, "GatewayClass", "", "istio-waypoint", _waypoint_for("workload"))
    found = _found(store)
    assert "waypoint" not in found[ECHO]["service"] and found[ECHO_POD]["workload"]["waypoint"] == WAYPOINT


def test_the_object_label_wins_and_none_opts_out() -> None:
    store = _store()
    _edit(store, "Service", "ambient", "echo", _set({"istio.io/use-waypoint": "none"}))
    assert "waypoint" not in _found(store)[ECHO]["service"]
    store = _store()
    _edit(store, "Namespace", "", "ambient", _set({"istio.io/use-waypoint": ""}))
    assert "waypoint" not in _found(store)[ECHO]["service"]
    _edit(store, "Service", "ambient", "echo", _set({"istio.io/use-waypoint": "waypoint"}))
    assert _found(store)[ECHO]["service"]["waypoint"] == WAYPOINT
    _edit(store, "Service", "ambient", "echo", _set({"istio.io/use-waypoint": "missing"}))
    assert "waypoint" not in _found(store)[ECHO]["service"]


def test_a_waypoint_without_endpoints_is_not_programmed_and_not_used() -> None:
    store = _store()
    store.delete(ObjectKey("Pod", "ambient", "waypoint-1"))
    store.delete(ObjectKey("EndpointSlice", "ambient", "waypoint-abcde"))
    snapshot = build_snapshot(store, "v1")
    gateway = snapshot.config.gateway_api.statuses[("KubernetesGateway", "ambient", "waypoint")]
    programmed = next(c for c in gateway["conditions"] if c["type"] == "Programmed")
    assert (programmed["status"], programmed["reason"]) == ("False", "AddressNotAssigned")
    assert "addresses" not in gateway
    assert "waypoint" not in _found(store)[ECHO]["service"]


def test_another_namespace_uses_a_waypoint_its_listener_admits() -> None:
    def legacy_uses_it(store: Store) -> None:
        _edit(store, "Service", "legacy", "web", _set({"istio.io/use-waypoint": "waypoint",
                                                       "istio.io/use-waypoint-namespace": "ambient"}))

    store = _store()
    legacy_uses_it(store)
    assert "waypoint" not in _found(store)["legacy/web.legacy.svc.cluster.local"]["service"]  # allowedRoutes: Same

    def allow(namespaces: dict[str, Any]) -> Any:
        return lambda raw: raw["spec"]["listeners"][0].update(allowedRoutes={"namespaces": namespaces})

    store = _store()
    legacy_uses_it(store)
    _edit(store, "KubernetesGateway", "ambient", "waypoint", allow({"from": "All"}))
    assert _found(store)["legacy/web.legacy.svc.cluster.local"]["service"]["waypoint"] == WAYPOINT

    store = _store()
    legacy_uses_it(store)
    _edit(store, "KubernetesGateway", "ambient", "waypoint",
          allow({"from": "Selector", "selector": {"matchLabels": {"waypoints": "shared"}}}))
    assert "waypoint" not in _found(store)["legacy/web.legacy.svc.cluster.local"]["service"]
    _edit(store, "Namespace", "", "legacy", _set({"waypoints": "shared"}))
    assert _found(store)["legacy/web.legacy.svc.cluster.local"]["service"]["waypoint"] == WAYPOINT
    # The namespace's own labels name it too.
    store = _store()
    _edit(store, "KubernetesGateway", "ambient", "waypoint", allow({"from": "All"}))
    _edit(store, "Namespace", "", "legacy", _set({"istio.io/use-waypoint": "waypoint",
                                                  "istio.io/use-waypoint-namespace": "ambient"}))
    assert _found(store)["legacy/web.legacy.svc.cluster.local"]["service"]["waypoint"] == WAYPOINT


async def test_a_waypoint_gateway_changed_pushes_ztunnel_the_services_that_use_it() -> None:
    store = _store()
    gateway = store.get(ObjectKey("KubernetesGateway", "ambient", "waypoint")).raw  # type: ignore[union-attr]
    store.delete(ObjectKey("KubernetesGateway", "ambient", "waypoint"))
    server, pusher, address = await _serve(store)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stream = _Stream(channel)
            stream.send(types.ADDRESS)
            first = await stream.receive()
            echo = next(r for r in first.resources if r.name == ECHO)
            assert not wpb.Address.FromString(echo.resource.value).service.HasField("waypoint")
            store.apply(gateway)  # nothing else changes: the waypoint alone
            pusher.publish()
            pushed = await stream.receive()
            assert [r.name for r in pushed.resources] == [ECHO]
            assert json_format.MessageToDict(wpb.Address.FromString(pushed.resources[0].resource.value)
                                             )["service"]["waypoint"] == WAYPOINT
            stream.requests.put_nowait(None)
    finally:
        await server.stop(None)


def test_a_pod_label_names_its_own_workload_waypoint() -> None:
    store = _store()
    _edit(store, "KubernetesGateway", "ambient", "waypoint", _waypoint_for("workload"))
    _edit(store, "Namespace", "", "ambient", _set({"istio.io/use-waypoint": ""}))
    _edit(store, "Pod", "ambient", "echo-1", _set({"istio.io/use-waypoint": "waypoint"}))
    found = _found(store)
    assert found[ECHO_POD]["workload"]["waypoint"] == WAYPOINT
    assert "waypoint" not in found["Kubernetes//Pod/ambient/echo-2"]["workload"]  # no label, nor its namespace


BLACKHOLE_CHAIN = {"name": "virtualInbound-blackhole", "filters": [{
    "name": "envoy.filters.network.tcp_proxy", "typedConfig": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "statPrefix": "BlackHoleCluster", "cluster": "BlackHoleCluster"}}]}
WAYPOINT_NODE = "waypoint~10.244.0.2~waypoint-1.ambient~ambient.svc.cluster.local"
WAYPOINT_LABELS = {"LABELS": {"gateway.networking.k8s.io/gateway-name": "waypoint",
                              "gateway.istio.io/managed": "istio.io-mesh-controller"}}


def _waypoint_config(store: Store, metadata: dict[str, Any] = WAYPOINT_LABELS) -> dict[str, dict[str, Any]]:
    """What the waypoint proxy is sent, by type then name, as JSON."""
    snapshot = build_snapshot(store, "v1")
    proxy = proxy_from_node(WAYPOINT_NODE, metadata)
    cache = ResourceCache()
    messages = {types.LISTENER: listener_pb2.Listener, types.CLUSTER: cluster_pb2.Cluster,
                types.ENDPOINT: endpoint_pb2.ClusterLoadAssignment}
    return {type_url: {r.name: json_format.MessageToDict(message.FromString(r.value))
                       for r in generators_for(proxy)[type_url](snapshot, proxy, None, cache)}
            for type_url, message in messages.items()}


def test_the_waypoint_proxy_terminates_hbone_routes_its_services_and_originates_hbone_to_their_pods() -> None:
    config = _waypoint_config(_store())
    listeners, clusters, endpoints = config[types.LISTENER], config[types.CLUSTER], config[types.ENDPOINT]
    assert set(listeners) == {"connect_terminate", "main_internal", "connect_originate"}
    terminate = listeners["connect_terminate"]
    assert terminate["address"]["socketAddress"]["portValue"] == 15008
    [chain] = terminate["filterChains"]
    assert chain["transportSocket"]["typedConfig"]["requireClientCertificate"] is True
    manager = chain["filters"][0]["typedConfig"]
    assert manager["http2ProtocolOptions"]["allowConnect"] is True
    [route] = manager["routeConfig"]["virtualHosts"][0]["routes"]
    assert route["route"]["cluster"] == "main_internal" and route["route"]["upgradeConfigs"][0]["upgradeType"] == "CONNECT"
    # The echo Service uses the waypoint: a chain per port, by its VIP; HTTP routed, TCP proxied.
    chains = {c["name"]: c for c in listeners["main_internal"]["filterChains"]}
    assert set(chains) == {"inbound-vip|80|http|echo.ambient.svc.cluster.local",
                           "inbound-vip|9000|tcp|echo.ambient.svc.cluster.local", "virtualInbound-blackhole"}
    http = chains["inbound-vip|80|http|echo.ambient.svc.cluster.local"]
    assert http["filterChainMatch"]["prefixRanges"] == [{"addressPrefix": "10.96.1.10", "prefixLen": 32}]
    routes = http["filters"][0]["typedConfig"]["routeConfig"]["virtualHosts"][0]["routes"]
    assert routes[0]["route"]["cluster"] == "inbound-vip|80|http|echo.ambient.svc.cluster.local"
    assert clusters["connect_originate"]["originalDstLbConfig"]["upstreamPortOverride"] == 15008
    # Endpoints: connect_originate, the ready pod's address:targetPort passed along in metadata.
    [group] = endpoints["inbound-vip|80|http|echo.ambient.svc.cluster.local"]["endpoints"]
    [endpoint] = group["lbEndpoints"]
    assert endpoint["endpoint"]["address"]["envoyInternalAddress"]["serverListenerName"] == "connect_originate"
    assert endpoint["metadata"]["filterMetadata"]["envoy.filters.listener.original_dst"] == {"local": "10.244.0.11:8080"}


def test_a_virtual_service_of_a_service_using_the_waypoint_is_applied_on_it() -> None:
    store = _store()
    store.apply({"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
                 "metadata": {"name": "echo", "namespace": "ambient"},
                 "spec": {"hosts": ["echo"], "http": [
                     {"match": [{"headers": {"x-canary": {"exact": "yes"}}}],
                      "route": [{"destination": {"host": "echo", "subset": "v1"}}]},
                     {"route": [{"destination": {"host": "echo"}}]}]}})
    listeners = _waypoint_config(store)[types.LISTENER]
    [http] = [c for c in listeners["main_internal"]["filterChains"] if "|http|" in c["name"]]
    routes = http["filters"][0]["typedConfig"]["routeConfig"]["virtualHosts"][0]["routes"]
    assert routes[0]["match"]["headers"][0]["name"] == "x-canary"
    assert routes[0]["route"]["cluster"] == "inbound-vip|80|http/v1|echo.ambient.svc.cluster.local"
    assert routes[1]["route"]["cluster"] == "inbound-vip|80|http|echo.ambient.svc.cluster.local"


def test_the_waypoint_gets_clusters_for_its_services_and_their_routes_destinations_only() -> None:
    """As istiod's: not every service of the mesh (a big mesh's waypoint would hold them all)."""
    store = _store()
    clusters = _waypoint_config(store)[types.CLUSTER]
    assert {n for n in clusters if n.startswith("inbound-vip|")} == {
        "inbound-vip|80|http|echo.ambient.svc.cluster.local", "inbound-vip|9000|tcp|echo.ambient.svc.cluster.local"}
    # A route of a served service to another one: its cluster too, and none of the rest.
    store.apply({"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
                 "metadata": {"name": "echo", "namespace": "ambient"},
                 "spec": {"hosts": ["echo"], "http": [{"route": [{"destination": {"host": "web.legacy.svc.cluster.local"}}]}]}})
    config = _waypoint_config(store)
    routed = {n for n in config[types.CLUSTER] if n.startswith("inbound-vip|")}
    assert routed == {"inbound-vip|80|http|echo.ambient.svc.cluster.local",
                      "inbound-vip|9000|tcp|echo.ambient.svc.cluster.local",
                      "inbound-vip|8080|http|web.legacy.svc.cluster.local"}
    assert routed <= set(config[types.ENDPOINT])


def test_a_waypoint_proxy_naming_no_waypoint_or_a_service_opted_out_routes_nothing() -> None:
    # Without the gateway-name label (or naming a Gateway that does not exist): no service's chain.
    for metadata in ({}, {"LABELS": {"gateway.networking.k8s.io/gateway-name": "elsewhere"}}):
        assert _waypoint_config(_store(), metadata)[types.LISTENER]["main_internal"]["filterChains"] == [BLACKHOLE_CHAIN]
    store = _store()
    _edit(store, "Service", "ambient", "echo", _set({"istio.io/use-waypoint": "none"}))
    assert _waypoint_config(store)[types.LISTENER]["main_internal"]["filterChains"] == [BLACKHOLE_CHAIN]


def test_a_policy_with_target_refs_applies_on_the_waypoint_only() -> None:
    store = _store()
    for name, ref in (("on-gateway", {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "waypoint"}),
                      ("on-service", {"group": "", "kind": "Service", "name": "echo"}),
                      ("on-other", {"group": "", "kind": "Service", "name": "other"})):
        store.apply({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
                     "metadata": {"name": name, "namespace": "ambient"},
                     "spec": {"targetRefs": [ref], "action": "DENY", "rules": [{"to": [{"operation": {"paths": [f"/{name}"]}}]}]}})
    listeners = _waypoint_config(store)[types.LISTENER]
    chains = {c["name"]: c for c in listeners["main_internal"]["filterChains"]}
    http = chains["inbound-vip|80|http|echo.ambient.svc.cluster.local"]["filters"][0]["typedConfig"]
    [rbac] = [f for f in http["httpFilters"] if f["name"].startswith("envoy.filters.http.rbac")]
    assert set(rbac["typedConfig"]["rules"]["policies"]) == {"ns[ambient]-policy[on-gateway]-rule[0]",
                                                           "ns[ambient]-policy[on-service]-rule[0]"}
    # On the TCP port, a DENY on HTTP paths denies every connection (istiod's semantics for TCP).
    tcp = chains["inbound-vip|9000|tcp|echo.ambient.svc.cluster.local"]["filters"]
    assert tcp[0]["name"].startswith("envoy.filters.network.rbac")
    # Not namespace-wide for the pods (ztunnel is not told of them), nor for a sidecar in the namespace.
    snapshot = build_snapshot(store, "v1")
    ztunnel = proxy_from_node(NODE, {})
    sent = {r.name for r in generators_for(ztunnel)[types.AUTHORIZATION](snapshot, ztunnel, None, ResourceCache())}
    assert "ambient/deny-range" in sent and not {"ambient/on-gateway", "ambient/on-service"} & sent
    assert not {"ambient/on-gateway", "ambient/on-service"} & set(_found(store)[ECHO_POD]["workload"]["authorizationPolicies"])
    sidecar = proxy_from_node("sidecar~10.244.0.11~echo-1.ambient~ambient.svc.cluster.local", {})
    assert all(not p.target_refs for p in authorization_policies(build_snapshot(store, "v1"), sidecar))


def test_a_waypoint_checks_the_callers_identity_kept_from_hbone() -> None:
    """The caller's certificate is seen by connect_terminate only: its URI SAN is kept as filter state
    io.istio.peer_principal, shared with main_internal, whose RBAC matches identities there (as istiod)."""
    store = _store()
    store.apply({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
                 "metadata": {"name": "from-a", "namespace": "ambient"},
                 "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "action": "ALLOW",
                          "rules": [{"from": [{"source": {"principals": ["cluster.local/ns/ambient/sa/a"],
                                                          "notNamespaces": ["x"]}}]}]}})
    listeners = _waypoint_config(store)[types.LISTENER]
    chains = {c["name"]: c for c in listeners["main_internal"]["filterChains"]}
    http = chains["inbound-vip|80|http|echo.ambient.svc.cluster.local"]["filters"][0]["typedConfig"]
    [rbac] = [f for f in http["httpFilters"] if f["name"].startswith("envoy.filters.http.rbac")]
    text = json.dumps(rbac)
    assert '"filterState": {"key": "io.istio.peer_principal", "stringMatch": {"exact": "spiffe://cluster.local/ns/ambient/sa/a"}}' in text
    assert "authenticated" not in text
    tcp = chains["inbound-vip|9000|tcp|echo.ambient.svc.cluster.local"]["filters"][0]
    assert "io.istio.peer_principal" in json.dumps(tcp) and "authenticated" not in json.dumps(tcp)
    terminate = listeners["connect_terminate"]["filterChains"][0]["filters"][0]["typedConfig"]["httpFilters"][0]
    kept = terminate["typedConfig"]["onRequestHeaders"][1]
    assert (kept["objectKey"], kept["factoryKey"], kept["sharedWithUpstream"]) == (
        "io.istio.peer_principal", "envoy.hashable_string", "ONCE")
    assert kept["formatString"]["textFormatSource"]["inlineString"] == "%DOWNSTREAM_PEER_URI_SAN%"


def test_a_waypoints_name_override_names_the_service_its_status_looks_for() -> None:
    store = _store()
    _edit(store, "KubernetesGateway", "ambient", "waypoint",
          lambda raw: raw["metadata"].setdefault("annotations", {}).update({"gateway.istio.io/name-override": "wp"}))
    gateway = build_snapshot(store, "v1").config.gateway_api.statuses[("KubernetesGateway", "ambient", "waypoint")]
    programmed = next(c for c in gateway["conditions"] if c["type"] == "Programmed")
    assert "wp.ambient.svc.cluster.local" in programmed["message"], programmed

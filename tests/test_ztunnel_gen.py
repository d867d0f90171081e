"""ztunnel's WDS: the translation (pure) and the ADS server serving it (real gRPC, in process)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import json_format, struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from istiod.gen.istio.security import authorization_pb2 as apb
from istiod.gen.istio.workload import workload_pb2 as wpb
from istiod.model.builder import build_snapshot
from istiod.model.config.common import Meta
from istiod.model.config.networking import ServiceEntry
from istiod.model.config.security import (
    Action, AuthorizationPolicy, Condition, MTLSMode, Operation, PeerAuthentication, Rule, Source,
)
from istiod.model.proxy import proxy_from_node
from istiod.model.snapshot import Snapshot
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Store
from istiod.xds import delta, types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen.ztunnel import addresses, authorizations, policies
from istiod.xds.gen.ztunnel.addresses import canonical_hosts
from istiod.xds.pusher import Pusher
from istiod.xds.server import DiscoveryServer, add_to_server
from tests.secure_port import TOKEN, start_secure

MESH = Path(__file__).parent / "data" / "ambient-mesh.yaml"
NODE = "ztunnel~10.244.0.1~ztunnel-x.istio-system~istio-system.svc.cluster.local"
ROOT = "istio-system"


def _store() -> Store:
    store = Store()
    for document in yaml.safe_load_all(MESH.read_text()):
        store.apply(document)
    return store


def _addresses(snapshot: Snapshot, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    proxy = proxy_from_node(NODE, {})
    return {r.name: json_format.MessageToDict(wpb.Address.FromString(r.value))
            for r in addresses(snapshot, proxy, names, ResourceCache())}


# --- Workloads and services -------------------------------------------------------------------

def test_a_redirected_pod_is_an_hbone_workload_with_its_services_policies_and_locality() -> None:
    found = _addresses(build_snapshot(_store(), "v1"))
    assert found["Kubernetes//Pod/ambient/echo-1"] == {"workload": {
        "uid": "Kubernetes//Pod/ambient/echo-1", "name": "echo-1", "namespace": "ambient",
        "addresses": ["CvQACw=="],  # 10.244.0.11
        "tunnelProtocol": "HBONE", "serviceAccount": "echo", "node": "node-a",
        "canonicalName": "echo", "canonicalRevision": "v1", "workloadName": "echo", "workloadType": "POD",
        "authorizationPolicies": ["ambient/echo-from-legacy", "istio-system/istio_converted_static_strict"],
        "clusterId": "Kubernetes",
        # The named target port `http` is the pod's 8080.
        "services": {"ambient/echo.ambient.svc.cluster.local": {"ports": [
            {"servicePort": 80, "targetPort": 8080}, {"servicePort": 9000, "targetPort": 9000}]}},
        "locality": {"region": "eu", "zone": "eu-1"},
    }}
    unready = found["Kubernetes//Pod/ambient/echo-2"]["workload"]
    assert unready["status"] == "UNHEALTHY"
    # Not redirected by istio-cni (opted out, not ambient, a sidecar): plain TCP. A Job of a CronJob is
    # named after the CronJob; every pod's type is POD, as istiod sends it.
    for uid in ("Kubernetes//Pod/ambient/batch-1", "Kubernetes//Pod/legacy/web-1", "Kubernetes//Pod/legacy/web-sidecar"):
        assert "tunnelProtocol" not in found[uid]["workload"]
    batch = found["Kubernetes//Pod/ambient/batch-1"]["workload"]
    assert (batch["workloadName"], batch["workloadType"]) == ("batch", "POD")


def test_a_service_has_its_vip_ports_and_its_namespace_waypoint_but_the_waypoint_not_itself() -> None:
    found = _addresses(build_snapshot(_store(), "v1"))
    assert found["ambient/echo.ambient.svc.cluster.local"] == {"service": {
        "name": "echo", "namespace": "ambient", "hostname": "echo.ambient.svc.cluster.local",
        "addresses": [{"address": "CmABCg=="}],  # 10.96.1.10
        # Port protocols by name (`http`, `tcp-raw`) as istiod tells ztunnel; a Service is canonical.
        "ports": [{"servicePort": 80, "appProtocol": "HTTP11"},
                  {"servicePort": 9000, "targetPort": 9000, "appProtocol": "TCP"}],
        "waypoint": {"hostname": {"namespace": "ambient", "hostname": "waypoint.ambient.svc.cluster.local"},
                     "hboneMtlsPort": 15008},
        "ipFamilies": "IPV4_ONLY", "canonical": True,
    }}
    assert "waypoint" not in found["ambient/waypoint.ambient.svc.cluster.local"]["service"]
    assert "waypoint" not in found["legacy/web.legacy.svc.cluster.local"]["service"]


def test_a_terminating_pod_is_unhealthy_and_an_entry_has_its_locality_and_capacity() -> None:
    store = _store()
    pod = copy.deepcopy(store.get(ObjectKey("Pod", "ambient", "echo-1")).raw)  # type: ignore[union-attr]
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    store.apply(pod)
    entry = copy.deepcopy(store.get(ObjectKey("WorkloadEntry", "legacy", "vm-1")).raw)  # type: ignore[union-attr]
    entry["spec"].update(locality="eu/eu-2/rack-1", weight=3)
    store.apply(entry)
    found = _addresses(build_snapshot(store, "v1"))
    assert found["Kubernetes//Pod/ambient/echo-1"]["workload"]["status"] == "UNHEALTHY"
    vm = found["Kubernetes/networking.istio.io/WorkloadEntry/legacy/vm-1"]["workload"]
    assert (vm["locality"], vm["capacity"]) == ({"region": "eu", "zone": "eu-2", "subzone": "rack-1"}, 3)


def test_pods_without_an_ip_or_finished_are_no_workloads() -> None:
    store = _store()
    finished = copy.deepcopy(store.get(ObjectKey("Pod", "legacy", "web-1")).raw)  # type: ignore[union-attr]
    finished["metadata"]["name"], finished["status"]["phase"] = "web-done", "Succeeded"
    store.apply(finished)
    found = _addresses(build_snapshot(store, "v1"))
    assert "Kubernetes//Pod/ambient/echo-3" not in found and "Kubernetes//Pod/legacy/web-done" not in found


def test_entries_are_workloads_in_the_services_that_select_them() -> None:
    found = _addresses(build_snapshot(_store(), "v1"))
    vm = found["Kubernetes/networking.istio.io/WorkloadEntry/legacy/vm-1"]["workload"]
    assert vm["services"] == {"legacy/web.legacy.svc.cluster.local": {"ports": [{"servicePort": 8080, "targetPort": 8080}]}}
    assert (vm["serviceAccount"], vm["workloadName"]) == ("vm", "vm-1")
    endpoint = found["Kubernetes/networking.istio.io/ServiceEntry/legacy/external-db/192.0.2.7"]["workload"]
    assert endpoint["services"] == {"legacy/db.example.com": {"ports": [{"servicePort": 5432, "targetPort": 5432}]}}
    assert "serviceAccount" not in endpoint  # none given: none sent
    assert found["legacy/db.example.com"]["service"]["addresses"] == [{"address": "8AAABQ=="}]  # 240.0.0.5
    assert found["legacy/db.example.com"]["service"]["canonical"]  # no Service and no earlier entry has the host
    assert found["legacy/db.example.com"]["service"]["ports"] == [
        {"servicePort": 5432, "targetPort": 5432, "appProtocol": "TCP"}]


def test_on_demand_names_find_by_address_or_host_and_a_malformed_one_nothing(caplog: pytest.LogCaptureFixture) -> None:
    snapshot = build_snapshot(_store(), "v1")
    assert set(_addresses(snapshot, ["/10.244.0.11"])) == {"Kubernetes//Pod/ambient/echo-1"}
    assert set(_addresses(snapshot, ["/10.96.1.10"])) == {"ambient/echo.ambient.svc.cluster.local"}
    assert set(_addresses(snapshot, ["ambient/echo.ambient.svc.cluster.local"])) == {
        "ambient/echo.ambient.svc.cluster.local"}
    assert _addresses(snapshot, ["/10.1.2.3", "ambient/nothing.example"]) == {}  # well formed, naming nothing
    assert _addresses(snapshot, ["no-slash", "/", "a/b/c"]) == {}
    assert "on-demand name is neither network/IP nor namespace/hostname" in caplog.text


def test_one_pod_changed_rebuilds_only_its_workload() -> None:
    store = _store()
    before = build_snapshot(store, "v1")
    cache = ResourceCache()
    proxy = proxy_from_node(NODE, {})
    first = {r.name: r for r in addresses(before, proxy, None, cache)}
    pod = copy.deepcopy(store.get(ObjectKey("Pod", "ambient", "echo-2")).raw)  # type: ignore[union-attr]
    pod["status"]["conditions"][0]["status"] = "True"
    store.apply(pod)
    after = build_snapshot(store, "v2", before, [ObjectKey("Pod", "ambient", "echo-2")])
    second = {r.name: r for r in addresses(after, proxy, None, cache)}
    assert [n for n in first if second[n] is not first[n]] == ["Kubernetes//Pod/ambient/echo-2"]


# --- Policies ---------------------------------------------------------------------------------

def _policy(action: Action, *rules: Rule, namespace: str = "ns", selector: tuple[tuple[str, str], ...] = ()) -> AuthorizationPolicy:
    return AuthorizationPolicy(Meta("p", namespace), selector, action, tuple(rules))


def _dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message) if message is not None else {}


def test_scope_follows_selector_and_root_namespace_and_audit_is_not_sent() -> None:
    assert policies.authorization(_policy(Action.ALLOW, selector=(("app", "a"),)), ROOT).scope == apb.WORKLOAD_SELECTOR
    assert policies.authorization(_policy(Action.ALLOW), ROOT).scope == apb.NAMESPACE
    assert policies.authorization(_policy(Action.DENY, namespace=ROOT), ROOT).scope == apb.GLOBAL
    assert policies.authorization(_policy(Action.AUDIT), ROOT) is None
    assert policies.authorization(_policy(Action.CUSTOM), ROOT) is None


def test_l7_parts_drop_an_allow_rule_and_are_left_out_of_a_deny_rule() -> None:
    l7 = Rule(sources=(Source(namespaces=("a",)),), operations=(Operation(ports=(80,), methods=("GET",)),))
    l4 = Rule(sources=(Source(principals=("cluster.local/ns/a/sa/*",)),))
    assert _dict(policies.authorization(_policy(Action.ALLOW, l7, l4), ROOT))["rules"] == [
        {"clauses": [{"matches": [{"principals": [{"prefix": "cluster.local/ns/a/sa/"}]}]}]}]
    assert _dict(policies.authorization(_policy(Action.DENY, l7), ROOT))["rules"] == [
        {"clauses": [{"matches": [{"destinationPorts": [80]}]}, {"matches": [{"namespaces": [{"exact": "a"}]}]}]}]
    # An ALLOW with only L7 rules allows nothing at all (no rules), never everything.
    assert "rules" not in _dict(policies.authorization(_policy(Action.ALLOW, l7), ROOT))
    when = Rule(when=(Condition("request.headers[x]", ("1",)),))
    assert "rules" not in _dict(policies.authorization(_policy(Action.ALLOW, when), ROOT))
    assert _dict(policies.authorization(_policy(Action.DENY, when), ROOT))["rules"] == [{"clauses": [{"matches": [{}]}]}]


def test_service_accounts_as_istiod_sends_them() -> None:
    rule = Rule(sources=(Source(service_accounts=("web", "other/api"), not_service_accounts=("ns/old",)),))
    assert _dict(policies.authorization(_policy(Action.ALLOW, rule), ROOT))["rules"] == [{"clauses": [{"matches": [{
        "serviceAccounts": [{"namespace": "ns", "serviceAccount": "web"}, {"namespace": "other", "serviceAccount": "api"}],
        "notServiceAccounts": [{"namespace": "ns", "serviceAccount": "old"}]}]}]}]


def test_l4_conditions_and_string_forms() -> None:
    rule = Rule(sources=(Source(principals=("*", "*/sa/x", "a*", "exact"), ip_blocks=("10.0.0.0/8", "10.1.1.1")),),
                when=(Condition("destination.port", ("80",), ("81",)), Condition("source.ip", ("bad-ip", "::1"))))
    assert _dict(policies.authorization(_policy(Action.ALLOW, rule), ROOT))["rules"] == [{"clauses": [
        {"matches": [{"principals": [{"presence": {}}, {"suffix": "/sa/x"}, {"prefix": "a"}, {"exact": "exact"}],
                      "sourceIps": [{"address": "CgAAAA==", "length": 8}, {"address": "CgEBAQ==", "length": 32}]}]},
        {"matches": [{"destinationPorts": [80], "notDestinationPorts": [81]}]},
        {"matches": [{"sourceIps": [{"address": "AAAAAAAAAAAAAAAAAAAAAQ==", "length": 128}]}]},
    ]}]


_L7 = st.sampled_from(["hosts", "not_hosts", "methods", "not_methods", "paths", "not_paths"])
_SOURCE_L7 = st.sampled_from(["request_principals", "not_request_principals", "remote_ip_blocks", "not_remote_ip_blocks"])


@st.composite
def _rules(draw: st.DrawFn) -> Rule:
    operations = tuple(Operation(ports=tuple(draw(st.lists(st.sampled_from([80, 443]), max_size=2))),
                                 **({draw(_L7): ("x",)} if draw(st.booleans()) else {}))
                       for _ in range(draw(st.integers(0, 2))))
    sources = tuple(Source(namespaces=tuple(draw(st.lists(st.sampled_from(["a", "b*"]), max_size=2))),
                           **({draw(_SOURCE_L7): ("x",)} if draw(st.booleans()) else {}))
                    for _ in range(draw(st.integers(0, 2))))
    return Rule(sources, operations)


def _has_l7(rule: Rule) -> bool:
    return any(getattr(o, f) for o in rule.operations for f in ("hosts", "not_hosts", "methods", "not_methods", "paths", "not_paths")) \
        or any(getattr(s, f) for s in rule.sources for f in ("request_principals", "not_request_principals",
                                                              "remote_ip_blocks", "not_remote_ip_blocks"))


@given(st.lists(_rules(), max_size=4))
def test_never_more_permissive_than_written(rules: list[Rule]) -> None:
    """An ALLOW keeps exactly its L4-only rules (so it allows no more); a DENY keeps every rule (so it
    denies no less), each with no more clauses than the rule has parts."""
    allow = policies.authorization(_policy(Action.ALLOW, *rules), ROOT)
    deny = policies.authorization(_policy(Action.DENY, *rules), ROOT)
    assert allow is not None and deny is not None
    assert len(allow.rules) == sum(not _has_l7(r) for r in rules)
    assert len(deny.rules) == len(rules)
    for rule, converted in zip(rules, deny.rules):
        assert len(converted.clauses) == bool(rule.operations) + bool(rule.sources)


def _peer(namespace: str, mode: MTLSMode, selector: tuple[tuple[str, str], ...] = (),
          ports: tuple[tuple[int, MTLSMode], ...] = (), name: str = "pa") -> PeerAuthentication:
    return PeerAuthentication(Meta(name, namespace), selector, mode, ports)


STRICT_REF = f"{ROOT}/{policies.STATIC_STRICT_NAME}"
APP = (("app", "a"),)


@pytest.mark.parametrize(("peers", "expected"), [
    ([], []),
    ([_peer(ROOT, MTLSMode.STRICT)], [STRICT_REF]),
    ([_peer(ROOT, MTLSMode.STRICT), _peer("ns", MTLSMode.PERMISSIVE)], []),
    ([_peer(ROOT, MTLSMode.PERMISSIVE), _peer("ns", MTLSMode.UNSET), _peer("ns", MTLSMode.STRICT, APP, name="w")],
     [STRICT_REF]),
    ([_peer("ns", MTLSMode.STRICT, APP, ((8080, MTLSMode.PERMISSIVE),))], ["ns/converted_peer_authentication_pa"]),
    ([_peer("ns", MTLSMode.PERMISSIVE, APP, ((9000, MTLSMode.STRICT),))], ["ns/converted_peer_authentication_pa"]),
    ([_peer("ns", MTLSMode.STRICT, (("app", "other"),))], []),  # selects another workload
    ([_peer("ns", MTLSMode.STRICT), _peer("ns", MTLSMode.UNSET, APP, ((8080, MTLSMode.PERMISSIVE),), name="w")],
     ["ns/converted_peer_authentication_w"]),
    # (istiod looks for PERMISSIVE ports only when the workload policy inherits STRICT)
    ([_peer("ns", MTLSMode.STRICT), _peer("ns", MTLSMode.UNSET, APP, ((8080, MTLSMode.DISABLE),), name="w")],
     [STRICT_REF]),
], ids=["none", "mesh-strict", "namespace-permissive-wins", "workload-strict", "strict-but-a-port", "a-port-strict",
        "not-selected", "inherits-strict-relaxes-a-port", "inherits-strict-disables-a-port"])
def test_workloads_name_the_peer_authentication_in_force(peers: list[PeerAuthentication], expected: list[str]) -> None:
    assert policies.workload_policies([], peers, "ns", dict(APP), ROOT) == expected


def test_port_level_peer_authentication_becomes_a_deny_of_plaintext() -> None:
    relaxed = policies.converted(_peer("ns", MTLSMode.STRICT, APP, ((8080, MTLSMode.PERMISSIVE),)), None, None, ROOT)
    assert _dict(relaxed) == {"name": "converted_peer_authentication_pa", "namespace": "ns", "scope": "WORKLOAD_SELECTOR",
                              "action": "DENY", "rules": [{"clauses": [
                                  {"matches": [{"notPrincipals": [{"presence": {}}]}]},
                                  {"matches": [{"notDestinationPorts": [8080]}]}]}]}
    tightened = policies.converted(_peer("ns", MTLSMode.PERMISSIVE, APP, ((9000, MTLSMode.STRICT),)), None, None, ROOT)
    assert _dict(tightened)["rules"] == [{"clauses": [{"matches": [
        {"notPrincipals": [{"presence": {}}], "destinationPorts": [9000]}]}]}]
    # UNSET under a STRICT namespace, relaxing a port: the namespace's STRICT merged in.
    inherited = policies.converted(_peer("ns", MTLSMode.UNSET, APP, ((8080, MTLSMode.DISABLE),)),
                                   _peer("ns", MTLSMode.STRICT, name="ns-wide"), None, ROOT)
    assert _dict(inherited)["rules"] == [{"clauses": [{"matches": [{"notDestinationPorts": [8080]}]},
                                                      {"matches": [{"notPrincipals": [{"presence": {}}]}]}]}]
    assert policies.converted(_peer("ns", MTLSMode.STRICT, APP), None, None, ROOT) is None  # the static policy covers it
    assert policies.converted(_peer("ns", MTLSMode.STRICT, APP, ((1, MTLSMode.STRICT),)), None, None, ROOT) is None
    assert policies.converted(_peer(ROOT, MTLSMode.STRICT, APP, ((1, MTLSMode.PERMISSIVE),)), None, None, ROOT) is None


def test_the_static_strict_policy_is_sent_once_any_peer_authentication_exists() -> None:
    proxy = proxy_from_node(NODE, {})
    found = {r.name: _dict(apb.Authorization.FromString(r.value))
             for r in authorizations(build_snapshot(_store(), "v1"), proxy, None, ResourceCache())}
    assert set(found) == {"ambient/deny-range", "ambient/echo-from-legacy", STRICT_REF}  # not the AUDIT one
    assert found[STRICT_REF] == {"name": policies.STATIC_STRICT_NAME, "namespace": ROOT, "scope": "WORKLOAD_SELECTOR",
                                 "action": "DENY",
                                 "rules": [{"clauses": [{"matches": [{"notPrincipals": [{"presence": {}}]}]}]}]}


# --- The ADS server ---------------------------------------------------------------------------

class _Stream:
    """A delta ADS stream as ztunnel opens it: the node on each type's first request, ACKs."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.requests: asyncio.Queue[discovery_pb2.DeltaDiscoveryRequest | None] = asyncio.Queue()
        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources(self._requests())

    async def _requests(self) -> AsyncIterator[discovery_pb2.DeltaDiscoveryRequest]:
        while (request := await self.requests.get()) is not None:
            yield request

    def send(self, type_url: str, subscribe: tuple[str, ...] = (), unsubscribe: tuple[str, ...] = (),
             nonce: str = "") -> None:
        metadata = struct_pb2.Struct()
        metadata.update({"NAMESPACE": "istio-system", "NODE_NAME": "node-a"})
        self.requests.put_nowait(discovery_pb2.DeltaDiscoveryRequest(
            node=base_pb2.Node(id=NODE, metadata=metadata), type_url=type_url, response_nonce=nonce,
            resource_names_subscribe=subscribe, resource_names_unsubscribe=unsubscribe))

    async def receive(self) -> discovery_pb2.DeltaDiscoveryResponse:
        response = await asyncio.wait_for(self.call.read(), 10)
        assert isinstance(response, discovery_pb2.DeltaDiscoveryResponse)
        self.send(response.type_url, nonce=response.nonce)  # ACK
        return response


async def _serve(store: Store) -> tuple[grpc.aio.Server, Pusher, str]:
    pusher = Pusher(store)
    server = DiscoveryServer(lambda: pusher.snapshot)
    pusher.subscribe(server.on_push)
    pusher.publish(full=True)
    server.ready = True
    grpc_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_to_server(server, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    return grpc_server, pusher, f"127.0.0.1:{port}"


async def test_a_ztunnel_gets_everything_then_only_what_each_change_changed() -> None:
    store = _store()
    server, pusher, address = await _serve(store)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stream = _Stream(channel)
            stream.send(types.ADDRESS)
            stream.send(types.AUTHORIZATION)
            first = {r.type_url: r for r in [await stream.receive(), await stream.receive()]}
            assert len(first[types.ADDRESS].resources) == 12 and len(first[types.AUTHORIZATION].resources) == 3
            scaled = copy.deepcopy(store.get(ObjectKey("Pod", "ambient", "echo-1")).raw)  # type: ignore[union-attr]
            scaled["metadata"]["name"], scaled["status"]["podIP"] = "echo-4", "10.244.0.14"
            store.apply(scaled)
            pusher.publish()
            pushed = await stream.receive()
            assert [r.name for r in pushed.resources] == ["Kubernetes//Pod/ambient/echo-4"] and not pushed.removed_resources
            store.delete(ObjectKey("Pod", "ambient", "echo-2"))
            pusher.publish()
            pushed = await stream.receive()
            assert not pushed.resources and list(pushed.removed_resources) == ["Kubernetes//Pod/ambient/echo-2"]
            # A policy edit: the policy, and (the same workloads name it) no Address.
            policy = copy.deepcopy(store.get(ObjectKey("AuthorizationPolicy", "ambient", "deny-range")).raw)  # type: ignore[union-attr]
            policy["spec"]["rules"][0]["when"][0]["values"] = ["9001"]
            store.apply(policy)
            pusher.publish()
            pushed = await stream.receive()
            assert (pushed.type_url, [r.name for r in pushed.resources]) == (types.AUTHORIZATION, ["ambient/deny-range"])
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(stream.call.read(), 0.3)
            stream.requests.put_nowait(None)
    finally:
        await server.stop(None)


def test_subscribing_and_unsubscribing_the_wildcard_at_once_asks_for_nothing() -> None:
    request = discovery_pb2.DeltaDiscoveryRequest(type_url=types.ADDRESS, resource_names_subscribe=["*"],
                                                  resource_names_unsubscribe=["*"])
    watched, changed = delta.subscribe(None, request, 10)
    assert watched.names == [] and changed


async def test_on_demand_starts_with_nothing_and_a_malformed_name_keeps_the_stream() -> None:
    server, _, address = await _serve(_store())
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stream = _Stream(channel)
            stream.send(types.ADDRESS, subscribe=("*",), unsubscribe=("*",))  # ztunnel's "nothing yet"
            empty = await stream.receive()
            assert not empty.resources and not empty.removed_resources
            # What names nothing (malformed, or nothing there) is answered as removed, as Istio does:
            # ztunnel waits for an answer to each name.
            stream.send(types.ADDRESS, subscribe=("not a name", "/10.244.0.12"))
            found = await stream.receive()
            assert [r.name for r in found.resources] == ["Kubernetes//Pod/ambient/echo-2"]
            assert list(found.removed_resources) == ["not a name"]
            stream.send(types.ADDRESS, subscribe=("ambient/echo.ambient.svc.cluster.local",))
            found = await stream.receive()
            assert [r.name for r in found.resources] == ["ambient/echo.ambient.svc.cluster.local"]
            assert not found.removed_resources
            stream.send(types.ADDRESS, subscribe=("/10.9.9.9", "ambient/nothing.ambient.svc.cluster.local"))
            unknown = await stream.receive()
            assert not unknown.resources
            assert sorted(unknown.removed_resources) == ["/10.9.9.9", "ambient/nothing.ambient.svc.cluster.local"]
            stream.requests.put_nowait(None)
    finally:
        await server.stop(None)


async def test_the_secure_port_refuses_a_ztunnel_whose_token_is_of_another_namespace(tmp_path: Path) -> None:
    secure = await start_secure(tmp_path)
    try:
        async with secure.channel(TOKEN) as channel:  # app/web, claiming istio-system
            stream = _Stream(channel)
            stream.send(types.ADDRESS)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stream.call.read()
            assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "istio-system" in (refused.value.details() or "")
    finally:
        await secure.port.stop()



_POD_OPS = st.lists(st.tuples(st.sampled_from(["add", "ready", "unready", "delete", "relabel"]), st.integers(0, 5)),
                    max_size=12)


@given(_POD_OPS)
def test_the_table_patched_pod_by_pod_is_the_table_made_whole(ops: list[tuple[str, int]]) -> None:
    """Snapshot after snapshot, the Address resources made from the previous ones (only the pods that
    changed made anew) are those made from nothing, byte for byte, and so are their addresses."""
    store = _store()
    template = store.get(ObjectKey("Pod", "ambient", "echo-1")).raw  # type: ignore[union-attr]
    snapshot = build_snapshot(store, "v0")
    proxy = proxy_from_node(NODE, {})
    cache = ResourceCache()
    addresses(snapshot, proxy, None, cache)
    for number, (op, i) in enumerate(ops, 1):
        key = ObjectKey("Pod", "ambient", f"gen-{i}")
        if op == "delete":
            store.delete(key)
        else:
            raw = copy.deepcopy(template)
            raw["metadata"]["name"], raw["status"]["podIP"] = key.name, f"10.244.9.{i + 1}"
            raw["status"]["conditions"][0]["status"] = "False" if op == "unready" else "True"
            if op == "relabel":
                raw["metadata"]["labels"] = {"app": "other"}
            store.apply(raw)
        snapshot = build_snapshot(store, f"v{number}", snapshot, [key])
        patched = {r.name: r.value for r in addresses(snapshot, proxy, None, cache)}
        whole = {r.name: r.value for r in addresses(snapshot, proxy, None, ResourceCache())}
        assert patched == whole
        by_address = addresses(snapshot, proxy, [f"/10.244.9.{j + 1}" for j in range(6)], cache)
        assert {r.name for r in by_address} == {n for n in whole if n.startswith("Kubernetes//Pod/ambient/gen-")}


def test_an_entry_is_canonical_for_a_host_no_service_or_earlier_entry_has_unless_it_is_namespace_local() -> None:
    taken = {"web.legacy.svc.cluster.local"}
    first = ServiceEntry(Meta("one", "a"), ("db.example.com", "web.legacy.svc.cluster.local"))
    second = ServiceEntry(Meta("two", "b"), ("db.example.com", "cache.example.com"))
    local = ServiceEntry(Meta("three", "c"), ("local.example.com",), export_to=(".",))
    assert canonical_hosts(first, taken) == {"db.example.com"}
    assert canonical_hosts(second, taken) == {"cache.example.com"}
    assert canonical_hosts(local, taken) == set()

"""Multi-network (split-horizon EDS): meshNetworks' gateways read as istiod reads them, and the
network filter: endpoints of another network replaced by its gateways, per network, never per proxy."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from envoy.config.endpoint.v3 import endpoint_pb2

from istiod.cli import build_parser
from istiod.model.builder import build_snapshot
from istiod.model.entries import TLS_MODE_LABEL
from istiod.model.mesh import MeshConfig, NetworkGateway
from istiod.model.proxy import Proxy, proxy_from_node
from istiod.model.service import NETWORK_LABEL, Endpoint, Locality
from istiod.model.snapshot import Snapshot
from istiod.sources.meshconfig import MeshConfigError, MeshConfigMapWatcher, parse_mesh_config, parse_mesh_networks
from istiod.settings import settings_from_args
from istiod.sources.fields import ConversionError
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen import PROXYLESS_GRPC, SIDECAR
from istiod.xds.changes import changes
from istiod.gatewaynames import GatewayNameResolver
from istiod.xds.gen.network import by_network, gateway_hostnames, with_service_gateways
from tests.ads_client import AdsClient
from tests.peers import Istiod, eventually
from tests.test_configdir import touch

MTLS = ((TLS_MODE_LABEL, "istio"),)
GW_N2 = NetworkGateway("n2", "192.0.2.2", 15443)
GW_N3A, GW_N3B = NetworkGateway("n3", "192.0.2.3", 15443), NetworkGateway("n3", "192.0.2.4", 15443)
GATEWAYS = (GW_N2, GW_N3A, GW_N3B)


def _addresses(endpoints: tuple[Endpoint, ...]) -> dict[tuple[str, int], int]:
    return {(e.address, e.port): e.weight for e in endpoints}


def test_without_gateways_nothing_changes() -> None:
    endpoints = (Endpoint("10.0.0.1", 80, 80, network="n2"), Endpoint("10.0.0.2", 80, 80, network="n1"))
    assert by_network(endpoints, "n1", MeshConfig(network_gateways=())) is endpoints


def test_remote_endpoints_become_their_gateways_weighted_by_count() -> None:
    endpoints = (
        Endpoint("10.0.1.1", 80, 80, labels=MTLS, network="n1"),
        Endpoint("10.0.2.1", 80, 80, labels=MTLS, network="n2"),
        Endpoint("10.0.2.2", 80, 80, labels=MTLS, network="n2", weight=3),
        Endpoint("10.0.3.1", 80, 80, labels=MTLS, network="n3"),
        Endpoint("10.0.9.1", 80, 80, labels=MTLS),  # no network: reached directly from every network
    )
    # Scale 2 (lcm of 1 and 2 gateways): n2's endpoints weigh (1+3)*2; n3's one endpoint splits in two.
    assert _addresses(by_network(endpoints, "n1", MeshConfig(network_gateways=GATEWAYS))) == {
        ("10.0.1.1", 80): 2, ("10.0.9.1", 80): 2,
        ("192.0.2.2", 15443): 8, ("192.0.2.3", 15443): 1, ("192.0.2.4", 15443): 1}
    # From n2, its own endpoints are direct and n1's (which has no gateway) too.
    assert _addresses(by_network(endpoints, "n2", MeshConfig(network_gateways=GATEWAYS))) == {
        ("10.0.1.1", 80): 2, ("10.0.2.1", 80): 2, ("10.0.2.2", 80): 6, ("10.0.9.1", 80): 2,
        ("192.0.2.3", 15443): 1, ("192.0.2.4", 15443): 1}


def test_gateway_endpoint_is_mtls_and_keeps_the_locality() -> None:
    where = Locality("r1", "z1")
    [gateway] = by_network((Endpoint("10.0.2.1", 80, 80, labels=MTLS, network="n2", locality=where),), "n1", MeshConfig(network_gateways=(GW_N2,)))
    assert (gateway.address, gateway.port, gateway.locality, gateway.network) == ("192.0.2.2", 15443, where, "n2")
    assert dict(gateway.labels)[TLS_MODE_LABEL] == "istio"


def test_plaintext_and_unready_remote_endpoints_are_dropped() -> None:
    endpoints = (Endpoint("10.0.2.1", 80, 80, network="n2"),  # no sidecar: the gateway could not route it
                 Endpoint("10.0.2.2", 80, 80, labels=MTLS, network="n2", healthy=False))
    assert by_network(endpoints, "n1", MeshConfig(network_gateways=(GW_N2,))) == ()


def test_proxy_without_network_goes_through_the_gateway() -> None:
    # istiod: an unset ISTIO_META_NETWORK still crosses by gateway to a network that has one.
    [gateway] = by_network((Endpoint("10.0.2.1", 80, 80, labels=MTLS, network="n2"),), "", MeshConfig(network_gateways=(GW_N2,)))
    assert gateway.address == "192.0.2.2"


MESH_NETWORKS = """
meshNetworks:
  networks:
    n2:
      gateways:
      - {address: 192.0.2.2, port: 15443}
    n3:
      gateways:
      - {address: 192.0.2.4, port: 15443}
      - {address: 192.0.2.3, port: 15443}
"""


def test_mesh_networks_gateways_are_read() -> None:
    assert parse_mesh_config(MESH_NETWORKS, MeshConfig(), "mesh").network_gateways == GATEWAYS


@pytest.mark.parametrize(("text", "error"), [
    ("meshNetworks: {networks: {n2: {gateways: [{address: 'gw!.example.com', port: 15443}]}}}",
     "invalid network n2: 'gw!.example.com' is not a valid IP \\(hostname is allowed if RESOLVE_HOSTNAME_GATEWAYS"),
    ("meshNetworks: {networks: {n2: {gateways: [{address: 192.0.2.2}]}}}", "port number 0 must be in the range"),
    ("meshNetworks: {networks: {n2: {gateways: [{address: 192.0.2.2, port: 70000}]}}}", "port: 70000 is not in 1-65535"),
    ("meshNetworks: {networks: {n2: {gateways: [{registryServiceName: eastwest.istio-system.svc.cluster.local, "
     "port: 15443}]}}}", "registryServiceName is not supported"),
    ("meshNetworks: {networks: {n2: {endpoints: [{fromCidr: 10.0.2.0/240}]}}}", "is not a valid CIDR block"),
    ("meshNetworks: {networks: {n2: [1]}}", "networks.n2: expected a map"),
    ("meshNetworks: {networkz: {}}", "unknown field 'networkz'"),
])
def test_bad_mesh_networks_names_the_field(text: str, error: str) -> None:
    with pytest.raises(MeshConfigError, match=error):
        parse_mesh_config(text, MeshConfig(), "mesh")


def test_gateways_named_by_hostname_are_their_resolved_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    """RESOLVE_HOSTNAME_GATEWAYS (Istio's default true): a hostname gateway is kept, and stands for
    the addresses it resolved to (none yet: no gateway); turned off, it is refused with istiod's message."""
    text = "meshNetworks: {networks: {n2: {gateways: [{address: gw.example.com, port: 15443}]}}}"
    mesh = parse_mesh_config(text, MeshConfig(), "mesh")
    assert mesh.network_gateways == (NetworkGateway("n2", "gw.example.com", 15443),)
    snapshot = build_snapshot(Store(), "1", mesh=mesh)
    assert gateway_hostnames(snapshot) == {"gw.example.com"}
    assert with_service_gateways(snapshot).network_gateways == ()
    resolved = dataclasses.replace(mesh, gateway_addresses=(("gw.example.com", ("192.0.2.8", "192.0.2.9")),))
    assert with_service_gateways(dataclasses.replace(snapshot, mesh=resolved)).network_gateways == (
        NetworkGateway("n2", "192.0.2.8", 15443), NetworkGateway("n2", "192.0.2.9", 15443))
    monkeypatch.setenv("RESOLVE_HOSTNAME_GATEWAYS", "false")
    with pytest.raises(MeshConfigError, match="'gw.example.com' is not a valid IP"):
        parse_mesh_config(text, MeshConfig(), "mesh")


async def test_the_resolver_keeps_the_last_addresses_of_a_name_that_stops_resolving(
        caplog: pytest.LogCaptureFixture) -> None:
    changes_seen: list[dict[str, tuple[str, ...]]] = []
    resolver = GatewayNameResolver(lambda found: changes_seen.append(dict(found)))
    mesh = MeshConfig(network_gateways=(NetworkGateway("n2", "localhost", 15443),
                                        NetworkGateway("n3", "no-such-gateway.invalid", 15443)))
    resolver.want(build_snapshot(Store(), "1", mesh=mesh))
    await resolver.resolve()
    assert len(changes_seen) == 1 and "127.0.0.1" in changes_seen[0]["localhost"]
    assert "no-such-gateway.invalid" not in changes_seen[0]
    assert "network gateway name not resolved" in caplog.text and "no-such-gateway.invalid" in caplog.text
    await resolver.resolve()  # nothing changed: no second push
    assert len(changes_seen) == 1


def test_the_configmaps_mesh_networks_key_is_read_and_wins(caplog: pytest.LogCaptureFixture) -> None:
    """istiod reads MeshNetworks from the ConfigMap's key `meshNetworks`; it replaces the networks
    the key `mesh` names, a bad edit keeps the last good networks, and without it the mesh's stay."""
    key = MESH_NETWORKS.replace("meshNetworks:\n", "")
    assert parse_mesh_networks(key, "k").network_gateways == GATEWAYS
    seen: list[MeshConfig] = []
    watcher = MeshConfigMapWatcher.__new__(MeshConfigMapWatcher)  # no API client: only the writer side
    watcher.namespace, watcher.name, watcher.base, watcher.on_change = "istio-system", "istio", MeshConfig(), seen.append
    watcher.mesh = MeshConfig()
    mesh_key = "meshNetworks: {networks: {n9: {gateways: [{address: 192.0.2.9, port: 15443}]}}}"
    watcher.replace("ConfigMap", [{"data": {"mesh": mesh_key, "meshNetworks": key}}])
    assert seen[-1].network_gateways == GATEWAYS
    watcher.apply({"data": {"mesh": "", "meshNetworks": "networks: {n2: {endpoints: [{fromCidr: 10.0.2.0/99}]}}"}})
    assert watcher.mesh.network_gateways == GATEWAYS and len(seen) == 1
    assert "ConfigMap istio-system/istio key meshNetworks.networks.n2.endpoints[0]: invalid network n2" in caplog.text
    watcher.apply({"data": {"mesh": mesh_key}})
    assert seen[-1].network_gateways == (NetworkGateway("n9", "192.0.2.9", 15443),)
    watcher.apply({"data": {"meshNetworks": "networks: {}"}})
    assert seen[-1].network_gateways == ()


@pytest.mark.parametrize("text", ["[1]", "networks: [", "networks: {n2: {gateways: [{address: 'gw!', port: 1}]}}"])
def test_bad_mesh_networks_key_is_refused(text: str) -> None:
    with pytest.raises(MeshConfigError, match="^ConfigMap istio-system/istio key meshNetworks"):
        parse_mesh_networks(text, "ConfigMap istio-system/istio key meshNetworks")


SERVICE = {"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry", "metadata": {"name": "echo", "namespace": "demo"},
           "spec": {"hosts": ["echo.demo.svc.cluster.local"], "location": "MESH_INTERNAL", "resolution": "STATIC",
                    "ports": [{"number": 80, "name": "http", "protocol": "HTTP"}],
                    "workloadSelector": {"labels": {"app": "echo"}}}}


def _entry(name: str, address: str, network: str) -> dict[str, object]:
    return {"apiVersion": "networking.istio.io/v1", "kind": "WorkloadEntry", "metadata": {"name": name, "namespace": "demo"},
            "spec": {"address": address, "network": network, "labels": {"app": "echo"}, "serviceAccount": "echo"}}


def _sidecar(pod: str, ip: str, network: str) -> Proxy:
    return proxy_from_node(f"sidecar~{ip}~{pod}.demo~demo.svc.cluster.local", {"NETWORK": network} if network else {})


def _endpoints(snapshot: Snapshot, proxy: Proxy, cache: ResourceCache) -> list[tuple[str, int]]:
    [resource] = [r for r in SIDECAR[types.ENDPOINT](snapshot, proxy, None, cache)
                  if r.name == "outbound|80||echo.demo.svc.cluster.local"]
    assignment = endpoint_pb2.ClusterLoadAssignment.FromString(resource.value)
    return sorted((e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value)
                  for group in assignment.endpoints for e in group.lb_endpoints)


def test_eds_is_made_per_network_and_shared_within_one() -> None:
    store = Store()
    for document in (SERVICE, _entry("local", "10.0.1.1", "n1"), _entry("remote", "10.0.2.1", "n2")):
        store.apply(document)
    mesh = parse_mesh_config(MESH_NETWORKS, MeshConfig(), "mesh")
    snapshot, cache = build_snapshot(store, "v1", mesh=mesh), ResourceCache()
    n1, n1_too, n2 = _sidecar("a", "10.0.1.5", "n1"), _sidecar("b", "10.0.1.6", "n1"), _sidecar("c", "10.0.2.5", "n2")
    assert _endpoints(snapshot, n1, cache) == [("10.0.1.1", 80), ("192.0.2.2", 15443)]
    assert _endpoints(snapshot, n2, cache) == [("10.0.1.1", 80), ("10.0.2.1", 80)]  # n1 has no gateway
    first, second = SIDECAR[types.ENDPOINT](snapshot, n1, None, cache), SIDECAR[types.ENDPOINT](snapshot, n1_too, None, cache)
    assert all(x is y for x, y in zip(first, second))  # one network, one assignment
    # Without meshNetworks the mesh is one network: WorkloadEntry network changes nothing.
    flat = build_snapshot(store, "v1")
    assert _endpoints(flat, n1, ResourceCache()) == [("10.0.1.1", 80), ("10.0.2.1", 80)]


def test_requested_network_view_limits_the_endpoints_seen() -> None:
    """REQUESTED_NETWORK_VIEW (istiod's ProxyView): only endpoints of those networks, and of none,
    with or without gateways; proxies asking for the same view share the assignment."""
    store = Store()
    for document in (SERVICE, _entry("local", "10.0.1.1", "n1"), _entry("remote", "10.0.2.1", "n2"),
                     _entry("nowhere", "10.0.3.1", "")):
        store.apply(document)
    flat, cache = build_snapshot(store, "v1"), ResourceCache()

    def viewer(pod: str, view: object) -> Proxy:
        return proxy_from_node(f"sidecar~10.0.1.9~{pod}.demo~demo.svc.cluster.local",
                               {"NETWORK": "n1", "REQUESTED_NETWORK_VIEW": view})

    assert viewer("a", "n2, n1").network_view == ("n1", "n2") and viewer("a", ["n2"]).network_view == ("n2",)
    assert _endpoints(flat, viewer("a", "n2"), cache) == [("10.0.2.1", 80), ("10.0.3.1", 80)]
    assert _endpoints(flat, viewer("b", ""), cache) == [("10.0.1.1", 80), ("10.0.2.1", 80), ("10.0.3.1", 80)]
    first = SIDECAR[types.ENDPOINT](flat, viewer("c", "n1"), None, cache)
    assert all(x is y for x, y in zip(first, SIDECAR[types.ENDPOINT](flat, viewer("d", "n1"), None, cache)))
    # With gateways: a network outside the view is not reached through its gateway either.
    gatewayed = build_snapshot(store, "v1", mesh=parse_mesh_config(MESH_NETWORKS, MeshConfig(), "mesh"))
    assert _endpoints(gatewayed, viewer("e", "n1"), ResourceCache()) == [("10.0.1.1", 80), ("10.0.3.1", 80)]
    assert _endpoints(gatewayed, viewer("f", "n1,n2"), ResourceCache()) == [
        ("10.0.1.1", 80), ("10.0.3.1", 80), ("192.0.2.2", 15443)]


def test_a_pods_network_label_is_its_endpoints_network() -> None:
    store = Store()
    store.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": "demo"},
                 "spec": {"clusterIP": "10.96.0.11", "selector": {"app": "echo"}, "ports": [{"name": "http", "port": 80}]}})
    for name, ip, network in (("echo-1", "10.0.1.1", "n1"), ("echo-2", "10.0.2.1", "n2")):
        store.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": "demo", "labels": {"app": "echo", "topology.istio.io/network": network,
                                                          TLS_MODE_LABEL: "istio"}},
            "spec": {"containers": [{"name": "app"}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})
    snapshot = build_snapshot(store, "v1", mesh=parse_mesh_config(MESH_NETWORKS, MeshConfig(), "mesh"))
    assert {e.address: e.network for e in snapshot.endpoints_for("echo.demo.svc.cluster.local", 80)} == {
        "10.0.1.1": "n1", "10.0.2.1": "n2"}
    assert _endpoints(snapshot, _sidecar("a", "10.0.1.5", "n1"), ResourceCache()) == [("10.0.1.1", 80), ("192.0.2.2", 15443)]


def test_proxyless_clients_share_assignments_per_network() -> None:
    store = Store()
    for document in (SERVICE, _entry("local", "10.0.1.1", "n1"), _entry("remote", "10.0.2.1", "n2")):
        store.apply(document)
    snapshot = build_snapshot(store, "v1", mesh=parse_mesh_config(MESH_NETWORKS, MeshConfig(), "mesh"))
    cache, names = ResourceCache(), ["outbound|80||echo.demo.svc.cluster.local"]

    def addresses(resources: list[Resource]) -> list[str]:
        assignment = endpoint_pb2.ClusterLoadAssignment.FromString(resources[0].value)
        return sorted(e.endpoint.address.socket_address.address for g in assignment.endpoints for e in g.lb_endpoints)

    made = {name: PROXYLESS_GRPC[types.ENDPOINT](snapshot, _sidecar(name, ip, network), names, cache)
            for name, ip, network in (("a", "10.0.1.5", "n1"), ("b", "10.0.1.6", "n1"), ("c", "10.0.2.5", "n2"))}
    assert addresses(made["a"]) == ["10.0.1.1", "192.0.2.2"] and addresses(made["c"]) == ["10.0.1.1", "10.0.2.1"]
    assert made["a"][0] is made["b"][0]  # one network, one assignment


def test_endpoints_without_a_network_take_from_registry_else_from_cidr() -> None:
    """meshNetworks' endpoints, as istiod's kube registry: `fromRegistry` naming our cluster ID
    (Kubernetes) puts every endpoint without a network of its own there, else `fromCidr` does by IP;
    an endpoint's own network always wins."""
    text = """networks:
  n2:
    endpoints: [{fromCidr: 10.0.2.0/24}]
    gateways: [{address: 192.0.2.2, port: 15443}]
  n3:
    endpoints: [{fromCidr: 10.0.3.7/24}, {fromRegistry: other-cluster}]
    gateways: [{address: 192.0.2.3, port: 15443}]
"""
    mesh = parse_mesh_networks(text, "k").apply(MeshConfig())
    assert mesh.registry_network == "" and [c.cidr for c in mesh.network_cidrs] == ["10.0.2.0/24", "10.0.3.7/24"]
    endpoints = (Endpoint("10.0.1.1", 80, 80, labels=MTLS, kube=True), Endpoint("10.0.2.1", 80, 80, labels=MTLS, kube=True),
                 Endpoint("10.0.3.1", 80, 80, labels=MTLS, kube=True),
                 Endpoint("10.0.3.2", 80, 80, labels=MTLS, network="n1", kube=True),
                 Endpoint("10.0.2.9", 80, 80, labels=MTLS))  # a WorkloadEntry's: only its own network, as istiod
    assert _addresses(by_network(endpoints, "n1", mesh)) == {
        ("10.0.1.1", 80): 0, ("10.0.3.2", 80): 0, ("10.0.2.9", 80): 0, ("192.0.2.2", 15443): 1,
        ("192.0.2.3", 15443): 1}  # 0: unset
    registry = parse_mesh_networks(text + "  n4: {endpoints: [{fromRegistry: Kubernetes}]}\n", "k").apply(MeshConfig())
    assert registry.registry_network == "n4"  # n4 has no gateway: every registry endpoint is reached directly
    assert _addresses(by_network(endpoints, "n1", registry)) == {(e.address, 80): 0 for e in endpoints}


@pytest.mark.parametrize(("text", "error"), [
    ("networks: {n2: {endpoints: [{fromCidr: 10.0.2.0/33}]}}", "invalid network n2: 10.0.2.0/33 is not a valid CIDR block"),
    ("networks: {n2: {endpoints: [{fromRegistry: Bad_Cluster}]}}", "invalid network n2: invalid registry name: Bad_Cluster"),
    ("networks: {n2: {endpoints: [{fromZone: a}]}}", "unknown field 'fromZone'"),
])
def test_bad_network_endpoints_name_the_field(text: str, error: str) -> None:
    with pytest.raises(MeshConfigError, match=error):
        parse_mesh_networks(text, "k")


def test_networks_config_flag_wins_and_a_missing_file_is_left_to_the_configmap(tmp_path: Path) -> None:
    """pilot-discovery's --networksConfig: when the file exists its networks win over the mesh
    config's; when it does not, istiod goes on (in a cluster, the ConfigMap's key decides)."""
    (tmp_path / "mesh.yaml").write_text("meshNetworks: {networks: {n9: {gateways: [{address: 192.0.2.9, port: 1}]}}}")
    (tmp_path / "networks.yaml").write_text(MESH_NETWORKS.replace("meshNetworks:\n", ""))

    def settings(networks: str) -> tuple[NetworkGateway, ...]:
        args = build_parser().parse_args(["discovery", "--config-dir", str(tmp_path), "--mesh-config",
                                          str(tmp_path / "mesh.yaml"), "--networksConfig", str(tmp_path / networks)])
        return settings_from_args(args).mesh.network_gateways

    assert settings("networks.yaml") == GATEWAYS
    assert settings("absent.yaml") == (NetworkGateway("n9", "192.0.2.9", 1),)
    (tmp_path / "bad.yaml").write_text("networks: {n2: {endpoints: [{fromRegistry: Bad_Name}]}}")
    with pytest.raises(SystemExit, match=f"--networksConfig: mesh networks {tmp_path}/bad.yaml.networks.n2.endpoints"):
        settings("bad.yaml")


async def test_running_istiod_watches_the_networks_file(tmp_path: Path, start_istiod: Callable[..., Istiod]) -> None:
    config = tmp_path / "config"
    config.mkdir()
    config.joinpath("mesh.yaml").write_text(yaml.safe_dump_all([
        SERVICE, *({**e, "spec": {**e["spec"], "labels": {"app": "echo", TLS_MODE_LABEL: "istio"}}}  # type: ignore[dict-item]
                   for e in (_entry("local", "10.0.1.1", "n1"), _entry("remote", "10.0.2.1", "n2")))]))
    networks = tmp_path / "networks.yaml"
    networks.write_text("networks: {n2: {gateways: [{address: 192.0.2.2, port: 15443}]}}")
    istiod = start_istiod(config, "--networksConfig", str(networks))
    ads = AdsClient(istiod.xds_address, "sidecar~10.0.1.5~a.demo~demo.svc.cluster.local", "demo")
    ads.node.metadata.update({"NETWORK": "n1"})
    names = ["outbound|80||echo.demo.svc.cluster.local"]

    def addresses(response: object) -> list[str]:
        assignment = endpoint_pb2.ClusterLoadAssignment.FromString(getattr(response, "resources")[0].value)
        return sorted(e.endpoint.address.socket_address.address for g in assignment.endpoints for e in g.lb_endpoints)

    try:
        assert addresses(await ads.subscribe(types.ENDPOINT, names)) == ["10.0.1.1", "192.0.2.2"]
        touch(networks, "networks: {n2: {gateways: [{address: 192.0.2.7, port: 15443}]}}")
        assert addresses(await ads.receive()) == ["10.0.1.1", "192.0.2.7"]  # re-pushed, no restart
        touch(networks, "networks: {n2: {gateways: [{address: 'gw!', port: 15443}]}}")
        await eventually(lambda: "keeping the last good mesh config" in istiod.log(), 10, "the bad edit refused")
        assert "mesh networks" in istiod.log() and "is not a valid IP" in istiod.log()
    finally:
        await ads.close()


def test_the_label_of_istiods_namespace_is_the_default_network() -> None:
    """As istiod's kube registry: a Pod's endpoint without a network is in the network labelled on
    the system namespace (before meshNetworks' fromRegistry/fromCidr); a relabel changes EDS; a
    WorkloadEntry without a network keeps none, as istiod's."""
    store = Store()
    store.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": "demo"},
                 "spec": {"clusterIP": "10.96.0.11", "selector": {"app": "echo"}, "ports": [{"name": "http", "port": 80}]}})
    for name, ip, network in (("echo-1", "10.0.1.1", {NETWORK_LABEL: "n1"}), ("echo-2", "10.0.2.1", {})):
        store.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": "demo", "labels": {"app": "echo", TLS_MODE_LABEL: "istio", **network}},
            "spec": {"containers": [{"name": "app"}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})
    text = "networks: {n2: {gateways: [{address: 192.0.2.2, port: 15443}]}, n3: {endpoints: [{fromCidr: 10.0.2.0/24}]}}"
    mesh = parse_mesh_networks(text, "k").apply(MeshConfig())
    n1 = _sidecar("a", "10.0.1.5", "n1")
    assert _endpoints(build_snapshot(store, "v1", mesh=mesh), n1, ResourceCache()) == [("10.0.1.1", 80), ("10.0.2.1", 80)]
    store.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "istio-system",
                                                                       "labels": {NETWORK_LABEL: "n2"}}})
    snapshot = build_snapshot(store, "v2", mesh=mesh)
    assert _endpoints(snapshot, n1, ResourceCache()) == [("10.0.1.1", 80), ("192.0.2.2", 15443)]
    other = dataclasses.replace(mesh, system_namespace="istiod-elsewhere")  # POD_NAMESPACE names the system namespace
    assert _endpoints(build_snapshot(store, "v3", mesh=other), n1, ResourceCache()) == [("10.0.1.1", 80), ("10.0.2.1", 80)]


def _gateway_service(labels: dict[str, str], ports: list[int], status_ip: str = "192.0.2.8") -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "eastwest", "namespace": "istio-system",
                                                               "labels": labels},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.50", "externalIPs": ["192.0.2.9"],
                     "ports": [{"name": f"p{p}", "port": p} for p in ports]},
            "status": {"loadBalancer": {"ingress": [{"ip": status_ip}, {"hostname": "lb.example.com"}]}}}


@pytest.mark.parametrize(("labels", "ports", "gateways"), [
    ({NETWORK_LABEL: "n2"}, [15443], [("192.0.2.8", 15443), ("192.0.2.9", 15443)]),  # ingress IPs, then externalIPs
    ({NETWORK_LABEL: "n2", "networking.istio.io/gatewayPort": "16443"}, [16443], [("192.0.2.8", 16443), ("192.0.2.9", 16443)]),
    ({NETWORK_LABEL: "n2", "networking.istio.io/gatewayPort": "x"}, [15443], [("192.0.2.8", 15443), ("192.0.2.9", 15443)]),
    ({NETWORK_LABEL: "n2"}, [80], []),  # labelled, but not on the gateway port: not a gateway (istiod warns)
    ({}, [15443], []),
])
def test_gateways_from_services_labelled_with_their_network(labels: dict[str, str], ports: list[int],
                                                            gateways: list[tuple[str, int]]) -> None:
    store = Store()
    for document in (SERVICE, _entry("local", "10.0.1.1", "n1"), _entry("remote", "10.0.2.1", "n2")):
        if document["kind"] == "WorkloadEntry":
            document = {**document, "spec": {**document["spec"], "labels": {"app": "echo", TLS_MODE_LABEL: "istio"}}}  # type: ignore[dict-item]
        store.apply(document)
    store.apply(_gateway_service(labels, ports))
    snapshot = build_snapshot(store, "v1")
    assert [(g.address, g.port) for g in with_service_gateways(snapshot).network_gateways] == gateways
    expected = [("10.0.1.1", 80), *gateways] if gateways else [("10.0.1.1", 80), ("10.0.2.1", 80)]
    assert _endpoints(snapshot, _sidecar("a", "10.0.1.5", "n1"), ResourceCache()) == expected


def test_a_gateway_services_change_is_a_full_push() -> None:
    store = Store()
    store.apply(SERVICE)
    store.apply(_gateway_service({NETWORK_LABEL: "n2"}, [15443]))
    before = build_snapshot(store, "v1")
    store.apply(_gateway_service({NETWORK_LABEL: "n2"}, [15443], status_ip="192.0.2.10"))
    after = build_snapshot(store, "v2", before, list(store.keys("Service")))
    assert changes(before, after) is None


@pytest.mark.parametrize(("patch", "error"), [
    ({"spec": {"type": "LoadBalancer", "externalIPs": ["not-an-ip"], "ports": [{"port": 15443}]}}, "spec.externalIPs[0]"),
    ({"spec": {"type": "LoadBalancer", "ports": [{"port": 15443}]},
      "status": {"loadBalancer": {"ingress": [{"ip": "10.0.0.999"}]}}}, "status.loadBalancer.ingress[0].ip"),
])
def test_a_bad_external_address_names_the_field(patch: dict[str, object], error: str) -> None:
    body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "eastwest", "namespace": "istio-system",
                                                                "labels": {NETWORK_LABEL: "n2"}}, **patch}
    with pytest.raises(ConversionError, match=re.escape(error)):
        Store().apply(body)

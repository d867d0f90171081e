"""A Sidecar resource's ingress listeners, translated as istiod's do: they replace the service
ports as the sidecar's inbound chains (virtualInbound, or a listener Envoy binds for captureMode
NONE), their clusters go to defaultEndpoint, and `tls` terminates the caller's TLS where
PeerAuthentication disables mesh mTLS on the port. (tests/test_envoy_sidecar_ingress.py proves it
with a real Envoy.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2

from istiod.model.builder import build_snapshot
from istiod.model.proxy import proxy_from_node
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import SIDECAR

DATA = Path(__file__).parent / "data"
WEB_NODE = "sidecar~127.0.0.31~web-1.shop~shop.svc.cluster.local"
SIDECAR_RESOURCE = """apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: web, namespace: shop}
spec:
  workloadSelector: {labels: {app: web}}
  ingress:
  - port: {number: 9080, protocol: HTTP, name: http}
    defaultEndpoint: 127.0.0.1:7070
  - port: {number: 9443, protocol: HTTPS, name: https}
    defaultEndpoint: 127.0.0.1:7070
    tls: {mode: SIMPLE, serverCertificate: /etc/certs/web.pem, privateKey: /etc/certs/web.key}
  - port: {number: 9090, protocol: TCP, name: tcp}
    bind: 127.0.0.1
    captureMode: NONE
    defaultEndpoint: 0.0.0.0:9000
"""
DISABLE_9443 = """apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: web, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
  portLevelMtls: {"9443": {mode: DISABLE}}
"""


def _generate(*extra: str, node: str = WEB_NODE) -> tuple[dict[str, Any], dict[str, Any]]:
    """(listeners, clusters) by name for `node`, in the sidecar mesh plus the `extra` YAML."""
    store = Store()
    for text in ((DATA / "sidecar-mesh.yaml").read_text(), *extra):
        for document in yaml.safe_load_all(text):
            store.apply(document)
    snapshot = build_snapshot(store, "v1")
    proxy = proxy_from_node(node, {"LABELS": {"app": "web"}})
    listeners = {r.name: listener_pb2.Listener.FromString(r.value)
                 for r in SIDECAR[types.LISTENER](snapshot, proxy, None, ResourceCache())}
    clusters = {r.name: cluster_pb2.Cluster.FromString(r.value)
                for r in SIDECAR[types.CLUSTER](snapshot, proxy, None, ResourceCache())}
    return listeners, clusters


def _chains(listener: listener_pb2.Listener, name: str) -> list[listener_components_pb2.FilterChain]:
    return [c for c in listener.filter_chains if c.name == name]


def _hcm(chain: listener_components_pb2.FilterChain) -> hcm_pb2.HttpConnectionManager:
    manager = hcm_pb2.HttpConnectionManager()
    assert chain.filters[-1].typed_config.Unpack(manager)
    return manager


def _own_tls(chain: listener_components_pb2.FilterChain) -> tls_pb2.DownstreamTlsContext:
    context = tls_pb2.DownstreamTlsContext()
    assert chain.transport_socket.typed_config.Unpack(context)
    return context


def test_ingress_listeners_replace_the_service_ports() -> None:
    listeners, clusters = _generate(SIDECAR_RESOURCE, DISABLE_9443)
    inbound = listeners["virtualInbound"]
    # web's own port 8080 is gone (no PILOT_ALLOW_SIDECAR_SERVICE_INBOUND_LISTENER_MERGE); 9090 binds apart.
    assert not _chains(inbound, "0.0.0.0_8080") and "inbound|8080||" not in clusters
    assert not _chains(inbound, "127.0.0.1_9090")
    http = _chains(inbound, "0.0.0.0_9080")  # the pod's address is loopback: the wildcard names it
    assert [(c.filter_chain_match.transport_protocol, c.filter_chain_match.destination_port.value) for c in http] == [
        ("tls", 9080), ("raw_buffer", 9080)]  # PERMISSIVE, declared HTTP
    manager = _hcm(http[1])
    assert manager.stat_prefix == "inbound_0.0.0.0_9080"
    assert manager.route_config.virtual_hosts[0].routes[0].route.cluster == "inbound|9080||"
    # defaultEndpoint 127.0.0.1: a STATIC cluster to the app on loopback, which capture never takes.
    to_app = clusters["inbound|9080||"]
    assert to_app.type == cluster_pb2.Cluster.STATIC and not to_app.HasField("upstream_bind_config")
    address = to_app.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (address.address, address.port_value) == ("127.0.0.1", 7070)


def test_tls_terminates_the_callers_tls_where_mtls_is_disabled() -> None:
    listeners, _ = _generate(SIDECAR_RESOURCE, DISABLE_9443)
    [chain] = _chains(listeners["virtualInbound"], "0.0.0.0_9443")
    assert chain.filter_chain_match.transport_protocol == "tls"
    context = _own_tls(chain)
    # The files are the agent's to read and watch, over its SDS (istiod's file-cert resource).
    [certificate] = context.common_tls_context.tls_certificate_sds_secret_configs
    assert certificate.name == "file-cert:/etc/certs/web.pem~/etc/certs/web.key"
    assert certificate.sds_config.api_config_source.grpc_services[0].envoy_grpc.cluster_name == "sds-grpc"
    assert not context.require_client_certificate.value
    assert list(context.common_tls_context.alpn_protocols) == ["h2", "http/1.1"]
    # HTTPS once terminated is HTTP: an HCM to the app.
    assert _hcm(chain).route_config.virtual_hosts[0].routes[0].route.cluster == "inbound|9443||"


def test_mutual_tls_verifies_the_callers_certificate() -> None:
    mutual = SIDECAR_RESOURCE.replace("tls: {mode: SIMPLE,", "tls: {mode: MUTUAL, caCertificates: /etc/certs/ca.pem,")
    listeners, _ = _generate(mutual, DISABLE_9443)
    [chain] = _chains(listeners["virtualInbound"], "0.0.0.0_9443")
    context = _own_tls(chain)
    assert context.require_client_certificate.value
    combined = context.common_tls_context.combined_validation_context
    assert combined.validation_context_sds_secret_config.name == "file-root:/etc/certs/ca.pem"


def test_under_permissive_mtls_the_port_keeps_the_mesh_chains() -> None:
    """istiod's rule: ingress `tls` acts only where PeerAuthentication disables mTLS on the port; else
    the port's chains are the mesh's, for the protocol after termination (HTTPS: HTTP)."""
    listeners, _ = _generate(SIDECAR_RESOURCE)
    chains = _chains(listeners["virtualInbound"], "0.0.0.0_9443")
    assert [c.filter_chain_match.transport_protocol for c in chains] == ["tls", "raw_buffer"]
    assert not chains[1].HasField("transport_socket")
    assert "istio" in chains[0].filter_chain_match.application_protocols  # the mesh's ALPN, its certificate
    assert not _own_tls(chains[0]).common_tls_context.tls_certificates


def test_capture_mode_none_is_a_listener_envoy_binds() -> None:
    listeners, clusters = _generate(SIDECAR_RESOURCE)
    bound = listeners["127.0.0.1_9090"]
    address = bound.address.socket_address
    assert (address.address, address.port_value) == ("127.0.0.1", 9090)
    assert not bound.HasField("bind_to_port")  # Envoy's default: it binds
    assert bound.traffic_direction == 1  # INBOUND
    assert [f.name for f in bound.listener_filters] == ["envoy.filters.listener.tls_inspector"]  # mesh mTLS or not
    proxy = tcp_proxy_pb2.TcpProxy()
    assert bound.filter_chains[-1].filters[-1].typed_config.Unpack(proxy) and proxy.cluster == "inbound|9090||"
    # defaultEndpoint 0.0.0.0: the pod's address, from 127.0.0.6 so capture lets it through.
    to_app = clusters["inbound|9090||"]
    address = to_app.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (address.address, address.port_value) == ("127.0.0.31", 9000)
    assert to_app.upstream_bind_config.source_address.address == "127.0.0.6"


def test_a_routable_pod_address_names_the_chains_and_no_endpoint_is_the_original_destination() -> None:
    sidecar = """apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: shop}
spec:
  ingress:
  - port: {number: 9080, protocol: HTTP, name: http}
  - port: {number: 9081, protocol: HTTP, name: http-v6}
    defaultEndpoint: "[::1]:7070"
"""
    listeners, clusters = _generate(sidecar, node="sidecar~10.1.2.3~other-1.shop~shop.svc.cluster.local")
    assert _chains(listeners["virtualInbound"], "10.1.2.3_9080")  # istiod's GlobalUnicastIP
    assert clusters["inbound|9080||"].type == cluster_pb2.Cluster.ORIGINAL_DST
    # An IPv4-only pod's [::1] is its 127.0.0.1, as istiod resolves it.
    address = clusters["inbound|9081||"].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert address.address == "127.0.0.1"


def test_authorization_policies_act_on_ingress_chains() -> None:
    policy = """apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: web, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
  action: DENY
  rules: [{to: [{operation: {ports: ["9080", "9090"]}}]}]
"""
    listeners, _ = _generate(SIDECAR_RESOURCE, policy)
    [_, plaintext] = _chains(listeners["virtualInbound"], "0.0.0.0_9080")
    assert "envoy.filters.http.rbac.deny" in [f.name for f in _hcm(plaintext).http_filters]
    assert all("envoy.filters.network.rbac" in [f.name for f in c.filters] for c in listeners["127.0.0.1_9090"].filter_chains)


def test_strict_mtls_on_an_ingress_port() -> None:
    strict = DISABLE_9443.replace('portLevelMtls: {"9443": {mode: DISABLE}}', "mtls: {mode: STRICT}")
    listeners, _ = _generate(SIDECAR_RESOURCE, strict)
    assert [c.filter_chain_match.transport_protocol for c in _chains(listeners["virtualInbound"], "0.0.0.0_9080")] == ["tls"]


def test_an_ingress_port_without_protocol_is_sniffed() -> None:
    sniffed = SIDECAR_RESOURCE.replace("{number: 9080, protocol: HTTP, name: http}", "{number: 9080, name: web}")
    listeners, _ = _generate(sniffed)
    chains = _chains(listeners["virtualInbound"], "0.0.0.0_9080")
    assert ("raw_buffer", ("http/1.1", "h2c")) in [
        (c.filter_chain_match.transport_protocol, tuple(c.filter_chain_match.application_protocols)) for c in chains]
    inspector = next(f for f in listeners["virtualInbound"].listener_filters if f.name.endswith("http_inspector"))
    assert "start: 9080" not in str(inspector.filter_disabled)  # the HTTP inspector runs on 9080


def test_ingress_chains_name_their_sidecar_in_metadata() -> None:
    listeners, _ = _generate(SIDECAR_RESOURCE)
    for chain in (*_chains(listeners["virtualInbound"], "0.0.0.0_9080"), *listeners["127.0.0.1_9090"].filter_chains):
        assert chain.metadata.filter_metadata["istio"]["config"] == "/apis/networking.istio.io/v1/namespaces/shop/sidecar/web"
    assert not any(c.HasField("metadata") for c in _chains(listeners["virtualInbound"], "virtualInbound"))


def test_a_bound_ingress_listener_keeps_its_name_over_an_outbound_one() -> None:
    """istiod builds inbound listeners first: an outbound listener of the same name is left out."""
    sidecar = """apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: shop}
spec:
  ingress: [{port: {number: 80, protocol: TCP, name: tcp}, captureMode: NONE, defaultEndpoint: "127.0.0.1:8080"}]
"""
    store = Store()
    for text in ((DATA / "sidecar-mesh.yaml").read_text(), sidecar):
        for document in yaml.safe_load_all(text):
            store.apply(document)
    resources = SIDECAR[types.LISTENER](build_snapshot(store, "v1"), proxy_from_node(WEB_NODE, {}), None, ResourceCache())
    [only] = [listener_pb2.Listener.FromString(r.value) for r in resources if r.name == "0.0.0.0_80"]
    assert only.traffic_direction == 1  # INBOUND: web's outbound HTTP listener gave way


def test_an_ingress_listener_on_the_sidecars_own_port_is_left_out_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    sidecar = SIDECAR_RESOURCE.replace("number: 9080", "number: 15021")
    listeners, clusters = _generate(sidecar)
    assert "inbound|15021||" not in clusters and not _chains(listeners["virtualInbound"], "0.0.0.0_15021")
    assert "its port conflicts with the sidecar's own" in caplog.text and "15021" in caplog.text

"""The gateway generator's pure translation (model in, Envoy protos out), and Secrets read as TLS
credentials. (tests/test_envoy_gateway.py proves the same with a real Envoy and real requests.)"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from typing import Any

import grpc
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.fault.v3 import fault_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2

from istiod import logs
from istiod.ca.pki import cert_pem, key_pem
from istiod.model.builder import build_snapshot
from istiod.model.proxy import Proxy, proxy_from_node
from istiod.model.snapshot import Snapshot
from istiod.sources.convert import ConversionError, convert
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import ROUTER
from istiod.xds.gen.gateway import listeners as gateway_listeners
from istiod.xds.gen.gateway import secrets, servers
from istiod.xds.server import DiscoveryServer, add_to_server
from tests.conftest import render
from tests.pki import ca_cert, leaf_cert

GATEWAY_NODE = "router~127.0.0.60~ingress-1.istio-ingress~istio-ingress.svc.cluster.local"
INGRESS_LABELS = {"istio": "ingressgateway"}
WEB_CLUSTER = "outbound|80||web.shop.svc.cluster.local"
HTTPS_ROUTE = "https.8443.https.public.istio-ingress"


def server_credential(*hosts: str) -> tuple[bytes, bytes, bytes]:
    """(CA certificate, server certificate, server key) as PEM: what an operator puts in a Secret."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = ca_cert("gateway test CA", ca_key)
    return cert_pem(ca).encode(), cert_pem(leaf_cert(key, (ca, ca_key), dns=hosts)).encode(), key_pem(key)


def tls_secret(name: str, namespace: str, cert: bytes, key: bytes, keys: tuple[str, str] = ("tls.crt", "tls.key")) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": name, "namespace": namespace},
            "data": {keys[0]: base64.b64encode(cert).decode(), keys[1]: base64.b64encode(key).decode()}}


CREDENTIAL = server_credential("secure.example.com")


def _snapshot(*extra: dict[str, Any]) -> Snapshot:
    store = Store()
    text = render("gateway-mesh.yaml", app_ip="127.0.0.61", app_port=8080, bind="127.0.0.60", http_port=8080,
                  https_port=8443)
    for document in [*yaml.safe_load_all(text), tls_secret("web-cert", "istio-ingress", *CREDENTIAL[1:]), *extra]:
        store.apply(document)
    return build_snapshot(store, "v1")


def _proxy(node: str = GATEWAY_NODE, labels: dict[str, str] = INGRESS_LABELS, verified: bool = True) -> Proxy:
    return dataclasses.replace(proxy_from_node(node, {"LABELS": labels}), verified=verified)


def _generate(type_url: str, snapshot: Snapshot, message: Any, proxy: Proxy | None = None,
              names: list[str] | None = None) -> dict[str, Any]:
    resources = ROUTER[type_url](snapshot, proxy or _proxy(), names, ResourceCache())
    return {r.name: message.FromString(r.value) for r in resources}


def _hcm(chain: listener_pb2.FilterChain) -> hcm_pb2.HttpConnectionManager:
    return hcm_pb2.HttpConnectionManager.FromString(chain.filters[0].typed_config.value)


def test_a_listener_per_server_port_that_binds() -> None:
    listeners = _generate(types.LISTENER, _snapshot(), listener_pb2.Listener)
    assert set(listeners) == {"127.0.0.60_8080", "127.0.0.60_8443"}
    http = listeners["127.0.0.60_8080"]
    address = http.address.socket_address
    assert (address.address, address.port_value) == ("127.0.0.60", 8080)
    assert not http.HasField("bind_to_port")  # unlike a sidecar's outbound listeners, it binds
    hcm = _hcm(http.filter_chains[0])
    assert hcm.rds.route_config_name == "http.8080" and hcm.rds.config_source.HasField("ads")
    assert hcm.use_remote_address.value  # the gateway is the edge: the peer is the client
    assert [f.name for f in hcm.http_filters] == ["envoy.filters.http.fault", "envoy.filters.http.cors",
                                                  "envoy.filters.http.router"]


def test_policies_selecting_the_gateway_run_on_its_http_chains() -> None:
    """RequestAuthentication and AuthorizationPolicy (here CUSTOM, whose provider the mesh config
    lacks: its rules deny) selecting the gateway's labels, before the fault filter, as istiod."""
    selector = {"matchLabels": INGRESS_LABELS}
    policies = (
        {"apiVersion": "security.istio.io/v1", "kind": "RequestAuthentication",
         "metadata": {"name": "jwt", "namespace": "istio-ingress"},
         "spec": {"selector": selector, "jwtRules": [{"issuer": "https://issuer.test", "jwksUri": "https://x/jwks"}]}},
        {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
         "metadata": {"name": "ext", "namespace": "istio-ingress"},
         "spec": {"selector": selector, "action": "CUSTOM", "provider": {"name": "ext"},
                  "rules": [{"to": [{"operation": {"hosts": ["private.example.com"]}}]}]}},
    )
    listeners = _generate(types.LISTENER, _snapshot(*policies), listener_pb2.Listener)
    for listener in listeners.values():
        for chain in listener.filter_chains:
            assert [f.name for f in _hcm(chain).http_filters] == [
                "envoy.filters.http.jwt_authn", "envoy.filters.http.rbac.deny", "envoy.filters.http.fault",
                "envoy.filters.http.cors", "envoy.filters.http.router"]


def test_https_terminates_simple_tls_with_the_credential_over_sds() -> None:
    https = _generate(types.LISTENER, _snapshot(), listener_pb2.Listener)["127.0.0.60_8443"]
    assert [f.name for f in https.listener_filters] == ["envoy.filters.listener.tls_inspector"]
    (chain,) = https.filter_chains
    assert list(chain.filter_chain_match.server_names) == ["secure.example.com"]
    context = tls_pb2.DownstreamTlsContext.FromString(chain.transport_socket.typed_config.value)
    assert not context.require_client_certificate.value
    (sds,) = context.common_tls_context.tls_certificate_sds_secret_configs
    assert sds.name == "kubernetes://web-cert" and sds.sds_config.HasField("ads")
    assert list(context.common_tls_context.alpn_protocols) == ["h2", "http/1.1"]
    assert _hcm(chain).rds.route_config_name == HTTPS_ROUTE


def test_routes_come_from_the_virtual_services_bound_to_the_gateway() -> None:
    routes = _generate(types.ROUTE, _snapshot(), route_pb2.RouteConfiguration)
    assert set(routes) == {"http.8080", HTTPS_ROUTE}
    (host,) = routes["http.8080"].virtual_hosts
    assert (host.name, list(host.domains)) == ("web.example.com:8080", ["web.example.com", "web.example.com:*"])
    # The match for the mesh gateway only is left out; the rest is the shared translation.
    assert [r.name for r in host.routes] == ["teapot", "web"]
    assert {r.route.cluster for r in host.routes} == {WEB_CLUSTER}
    teapot = fault_pb2.HTTPFault.FromString(host.routes[0].typed_per_filter_config["envoy.filters.http.fault"].value)
    assert teapot.abort.http_status == 418
    (secure,) = routes[HTTPS_ROUTE].virtual_hosts
    assert list(secure.domains) == ["secure.example.com", "secure.example.com:*"]


def test_https_redirect_requires_tls_on_the_servers_hosts() -> None:
    redirect = {"apiVersion": "networking.istio.io/v1", "kind": "Gateway",
                "metadata": {"name": "redirect", "namespace": "istio-ingress"},
                "spec": {"selector": INGRESS_LABELS, "servers": [
                    {"port": {"number": 8081, "name": "http", "protocol": "HTTP"}, "bind": "127.0.0.60",
                     "hosts": ["shop/web.example.com"], "tls": {"httpsRedirect": True}}]}}
    bound = {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
             "metadata": {"name": "redirected", "namespace": "shop"},
             "spec": {"hosts": ["web.example.com"], "gateways": ["istio-ingress/redirect"],
                      "http": [{"route": [{"destination": {"host": "web"}}]}]}}
    routes = _generate(types.ROUTE, _snapshot(redirect, bound), route_pb2.RouteConfiguration)
    (host,) = routes["http.8081"].virtual_hosts
    assert host.require_tls == route_components_pb2.VirtualHost.ALL  # Envoy's 301 to https for every request
    assert routes["http.8080"].virtual_hosts[0].require_tls == route_components_pb2.VirtualHost.NONE


def test_server_hosts_restrict_the_virtual_services_namespace() -> None:
    other = {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
             "metadata": {"name": "sneaky", "namespace": "default"},
             "spec": {"hosts": ["web.example.com", "other.example.com"], "gateways": ["istio-ingress/public"],
                      "http": [{"route": [{"destination": {"host": "web.shop.svc.cluster.local"}}]}]}}
    routes = _generate(types.ROUTE, _snapshot(other), route_pb2.RouteConfiguration)
    # The server takes only shop's VirtualServices: `default` may not claim web.example.com.
    assert [h.name for h in routes["http.8080"].virtual_hosts] == ["web.example.com:8080"]
    assert [r.name for r in routes["http.8080"].virtual_hosts[0].routes] == ["teapot", "web"]


def test_a_proxy_no_gateway_selects_gets_no_listeners() -> None:
    snapshot = _snapshot()
    assert _generate(types.LISTENER, snapshot, listener_pb2.Listener, _proxy(labels={"istio": "egressgateway"})) == {}
    assert _generate(types.ROUTE, snapshot, route_pb2.RouteConfiguration, _proxy(labels={})) == {}


def test_clusters_are_the_meshs_outbound_ones() -> None:
    clusters = _generate(types.CLUSTER, _snapshot(), cluster_pb2.Cluster)
    assert set(clusters) == {"BlackHoleCluster", WEB_CLUSTER}
    assert clusters[WEB_CLUSTER].type == cluster_pb2.Cluster.EDS


def test_secrets_go_only_to_a_verified_gateway_of_the_secrets_namespace(caplog: pytest.LogCaptureFixture,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Every refusal logged, whatever an earlier test in this process logged within the throttle's minute.
    monkeypatch.setattr(secrets, "_refused", logs.Throttled(secrets.log, 0))
    snapshot = _snapshot(tls_secret("web-cert", "shop", *CREDENTIAL[1:]))
    names = ["kubernetes://web-cert"]
    (secret,) = _generate(types.SECRET, snapshot, secret_pb2.Secret, names=names).values()
    assert secret.name == "kubernetes://web-cert"
    assert secret.tls_certificate.certificate_chain.inline_bytes == CREDENTIAL[1]
    assert secret.tls_certificate.private_key.inline_bytes == CREDENTIAL[2]
    assert _generate(types.SECRET, snapshot, secret_pb2.Secret, names=None) == {}  # a wildcard gets none
    # Over plaintext xDS anyone may claim to be the gateway: nothing, as istiod.
    with caplog.at_level(logging.WARNING):
        assert _generate(types.SECRET, snapshot, secret_pb2.Secret, _proxy(verified=False), names) == {}
    assert "identity not verified" in caplog.text
    assert _generate(types.SECRET, snapshot, secret_pb2.Secret, names=["kubernetes://missing", "default"]) == {}
    other = "router~127.0.0.62~gw-1.other~other.svc.cluster.local"
    assert _generate(types.SECRET, snapshot, secret_pb2.Secret, _proxy(node=other), names) == {}
    mine = "router~127.0.0.62~gw-1.shop~shop.svc.cluster.local"
    assert set(_generate(types.SECRET, snapshot, secret_pb2.Secret, _proxy(node=mine), names)) == set(names)
    assert CREDENTIAL[2].decode() not in caplog.text


@pytest.mark.parametrize(("tls", "protocol", "reason"), [
    ({"mode": "MUTUAL", "serverCertificate": "/etc/c.pem", "privateKey": "/etc/k.pem", "caCertificates": "/etc/ca.pem",
      "verifyCertificateHash": ["ab" * 32]}, "HTTPS", "istiod ignores them with files"),
    ({"mode": "MUTUAL", "credentialName": "web-cert", "subjectAltNames": ["a"]}, "TLS", "subjectAltNames/caCertificates"),
    (None, "MONGO", "protocol MONGO is not implemented"),
])
def test_unsupported_servers_are_left_out_with_a_warning(tls: dict[str, Any] | None, protocol: str, reason: str,
                                                         caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    server: dict[str, Any] = {"port": {"number": 9443, "name": "other", "protocol": protocol}, "hosts": ["*"]}
    if tls is not None:
        server["tls"] = tls
    gateway = {"apiVersion": "networking.istio.io/v1", "kind": "Gateway",
               "metadata": {"name": "odd", "namespace": "istio-ingress"},
               "spec": {"selector": INGRESS_LABELS, "servers": [server]}}
    monkeypatch.setattr(servers, "_unsupported", logs.Throttled(servers.log, 0))  # every warning, for this test
    with caplog.at_level(logging.WARNING):
        listeners = _generate(types.LISTENER, _snapshot(gateway), listener_pb2.Listener)
    assert set(listeners) == {"127.0.0.60_8080", "127.0.0.60_8443"}
    assert reason in caplog.text and "istio-ingress/odd" in caplog.text


def test_secrets_read_as_credentials_and_never_printed() -> None:
    _, cert, key = CREDENTIAL
    for keys in (("tls.crt", "tls.key"), ("cert", "key")):
        _, credential = convert(tls_secret("c", "ns", cert, key, keys))
        assert (credential.cert_chain, credential.private_key) == (cert, key)
        assert key.decode() not in repr(credential) and "PRIVATE" not in repr(credential)
    string_data = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "ns"},
                   "stringData": {"tls.crt": cert.decode(), "tls.key": key.decode()}}
    assert convert(string_data)[1].usable
    token = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "t", "namespace": "ns"},
             "data": {"token": base64.b64encode(b"abc").decode()}}
    assert not convert(token)[1].usable  # not a credential, not an error either
    bad = [
        ({"tls.crt": base64.b64encode(cert).decode()}, "tls.crt and tls.key must both be set"),
        ({"tls.crt": "!!not base64", "tls.key": "eA=="}, "data.tls.crt: not valid base64"),
        ({"tls.crt": base64.b64encode(b"garbage").decode(), "tls.key": base64.b64encode(key).decode()},
         "data.tls.crt: not a PEM certificate chain"),
        ({"tls.crt": base64.b64encode(cert).decode(), "tls.key": base64.b64encode(cert).decode()},
         "data.tls.key: not a PEM private key"),
    ]
    for data, message in bad:
        with pytest.raises(ConversionError) as error:
            convert({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "b", "namespace": "ns"}, "data": data})
        assert message in str(error.value) and "BEGIN" not in str(error.value)


async def test_the_ads_server_sends_secrets_only_on_a_verified_stream() -> None:
    """A router is served at connect; its credential goes only on a stream whose caller the
    authorizer checked (the TLS port), never on the plaintext one."""
    discovery = DiscoveryServer(_snapshot)
    discovery.ready = True

    async def authorize(proxy: Proxy, context: grpc.aio.ServicerContext, peer: str) -> str:
        return "gateway"  # the caller proved it is this proxy

    plain, checked = grpc.aio.server(), grpc.aio.server()
    add_to_server(discovery, plain)
    add_to_server(discovery.authorized(authorize), checked)
    ports = [server.add_insecure_port("127.0.0.1:0") for server in (plain, checked)]
    for server in (plain, checked):
        await server.start()
    metadata = struct_pb2.Struct()
    metadata.update({"LABELS": INGRESS_LABELS})
    request = discovery_pb2.DiscoveryRequest(node=base_pb2.Node(id=GATEWAY_NODE, metadata=metadata),
                                             type_url=types.SECRET, resource_names=["kubernetes://web-cert"])
    try:
        sent = []
        for port in ports:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(iter([request]))
                response = await asyncio.wait_for(call.read(), 5)
                sent.append([secret_pb2.Secret.FromString(r.value).name for r in response.resources])
                call.cancel()
        assert sent == [[], ["kubernetes://web-cert"]]
    finally:
        for server in (plain, checked):
            await server.stop(None)


def _l4_gateway(*servers: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "networking.istio.io/v1", "kind": "Gateway", "metadata": {"name": "l4", "namespace": "istio-ingress"},
            "spec": {"selector": INGRESS_LABELS, "servers": [{"bind": "127.0.0.60", **s} for s in servers]}}


L4_ROUTES: dict[str, Any] = {"apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": {"name": "l4", "namespace": "shop"},
             "spec": {"hosts": ["*.example.com"], "gateways": ["istio-ingress/l4"],
                      "tls": [{"match": [{"sniHosts": ["a.example.com"], "port": 9443}],
                               "route": [{"destination": {"host": "web", "port": {"number": 80}}}]},
                              {"match": [{"sniHosts": ["b.example.com"], "gateways": ["istio-ingress/other"]}],
                               "route": [{"destination": {"host": "web"}}]}],
                      "tcp": [{"match": [{"port": 9000}], "route": [{"destination": {"host": "web"}}]}]}}


def _tcp_proxy(chain: listener_pb2.FilterChain) -> tcp_proxy_pb2.TcpProxy:
    assert chain.filters[0].name == "envoy.filters.network.tcp_proxy"
    return tcp_proxy_pb2.TcpProxy.FromString(chain.filters[0].typed_config.value)


def test_passthrough_routes_by_sni_without_terminating() -> None:
    gateway = _l4_gateway({"port": {"number": 9443, "name": "tls", "protocol": "TLS"}, "hosts": ["shop/*.example.com"],
                           "tls": {"mode": "PASSTHROUGH"}})
    listener = _generate(types.LISTENER, _snapshot(gateway, L4_ROUTES), listener_pb2.Listener)["127.0.0.60_9443"]
    assert [f.name for f in listener.listener_filters] == ["envoy.filters.listener.tls_inspector"]
    # The second tls route names another gateway: only the first is this one's.
    (chain,) = listener.filter_chains
    assert list(chain.filter_chain_match.server_names) == ["a.example.com"]
    assert not chain.HasField("transport_socket")  # never opened
    assert _tcp_proxy(chain).cluster == WEB_CLUSTER
    assert "127.0.0.60_9443" not in _generate(types.ROUTE, _snapshot(gateway, L4_ROUTES), route_pb2.RouteConfiguration)


def test_a_tcp_server_proxies_to_the_first_matching_tcp_route(caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The left-out listener logged, whatever an earlier test in this process logged within the throttle's minute.
    monkeypatch.setattr(gateway_listeners, "_empty", logs.Throttled(gateway_listeners.log, 0))
    gateway = _l4_gateway({"port": {"number": 9000, "name": "tcp", "protocol": "TCP"}, "hosts": ["shop/*"]},
                          {"port": {"number": 9001, "name": "tcp2", "protocol": "TCP"}, "hosts": ["shop/*"]})
    with caplog.at_level(logging.WARNING):
        listeners = _generate(types.LISTENER, _snapshot(gateway, L4_ROUTES), listener_pb2.Listener)
    (chain,) = listeners["127.0.0.60_9000"].filter_chains
    assert not listeners["127.0.0.60_9000"].listener_filters and not chain.HasField("filter_chain_match")
    assert _tcp_proxy(chain).cluster == WEB_CLUSTER
    # No tcp route matches port 9001: no listener (Envoy refuses one without chains), and a warning.
    assert "127.0.0.60_9001" not in listeners and "no VirtualService tcp or tls route matches" in caplog.text


def test_mutual_tls_requires_a_client_certificate_verified_by_the_cacert() -> None:
    gateway = _l4_gateway(
        {"port": {"number": 9443, "name": "mtls", "protocol": "HTTPS"}, "hosts": ["shop/secure.example.com"],
         "tls": {"mode": "MUTUAL", "credentialName": "web-cert"}},
        {"port": {"number": 9444, "name": "optional", "protocol": "TLS"}, "hosts": ["shop/*.example.com"],
         "tls": {"mode": "OPTIONAL_MUTUAL", "credentialName": "web-cert"}})
    routes = {**L4_ROUTES, "spec": {**L4_ROUTES["spec"], "tcp": [{"route": [{"destination": {"host": "web"}}]}]}}
    listeners = _generate(types.LISTENER, _snapshot(gateway, routes), listener_pb2.Listener)
    for name, required, alpn in (("127.0.0.60_9443", True, ["h2", "http/1.1"]), ("127.0.0.60_9444", False, [])):
        (chain,) = listeners[name].filter_chains
        context = tls_pb2.DownstreamTlsContext.FromString(chain.transport_socket.typed_config.value)
        assert context.require_client_certificate.value is required
        combined = context.common_tls_context.combined_validation_context  # istiod's shape
        assert combined.validation_context_sds_secret_config.name == "kubernetes://web-cert-cacert"
        assert list(context.common_tls_context.alpn_protocols) == alpn
    assert _tcp_proxy(listeners["127.0.0.60_9444"].filter_chains[0]).cluster == WEB_CLUSTER


SPKI = base64.b64encode(bytes(32)).decode()
CERT_HASH = ":".join(["AB"] * 32)


def test_several_credential_names_and_client_pins_make_istiods_downstream_context(caplog: pytest.LogCaptureFixture) -> None:
    """istiod's ApplyCredentialSDSToServerCommonTLSContext: one SDS certificate per credentialNames
    entry, the first one's `-cacert` verifying clients, combined with the SPKI and hash pins."""
    gateway = _l4_gateway(
        {"port": {"number": 9443, "name": "mtls", "protocol": "HTTPS"}, "hosts": ["shop/secure.example.com"],
         "tls": {"mode": "MUTUAL", "credentialNames": ["web-rsa", "web-cert"], "verifyCertificateSpki": [SPKI],
                 "verifyCertificateHash": [CERT_HASH]}},
        {"port": {"number": 9445, "name": "simple-pinned", "protocol": "HTTPS"}, "hosts": ["shop/secure.example.com"],
         "tls": {"mode": "SIMPLE", "credentialName": "web-cert", "verifyCertificateSpki": [SPKI]}})
    rsa = tls_secret("web-rsa", "istio-ingress", *CREDENTIAL[1:])
    with caplog.at_level(logging.WARNING):
        listeners = _generate(types.LISTENER, _snapshot(gateway, rsa, L4_ROUTES), listener_pb2.Listener)
    (chain,) = listeners["127.0.0.60_9443"].filter_chains
    common = tls_pb2.DownstreamTlsContext.FromString(chain.transport_socket.typed_config.value).common_tls_context
    assert [c.name for c in common.tls_certificate_sds_secret_configs] == ["kubernetes://web-rsa", "kubernetes://web-cert"]
    combined = common.combined_validation_context
    assert combined.validation_context_sds_secret_config.name == "kubernetes://web-rsa-cacert"
    assert list(combined.default_validation_context.verify_certificate_spki) == [SPKI]
    assert list(combined.default_validation_context.verify_certificate_hash) == [CERT_HASH]
    # Pins with SIMPLE would be ignored by istiod: the server is left out, naming the fields.
    assert "127.0.0.60_9445" not in listeners and "verifyCertificateSpki/Hash need MUTUAL" in caplog.text
    names = ["kubernetes://web-rsa", "kubernetes://web-cert"]
    assert sorted(_generate(types.SECRET, _snapshot(gateway, rsa), secret_pb2.Secret, names=names)) == sorted(names)


def test_the_cacert_comes_from_the_cacert_secret_else_the_credentials_ca_crt() -> None:
    ca, cert, key = CREDENTIAL
    with_ca = tls_secret("web-cert", "istio-ingress", cert, key)
    with_ca["data"]["ca.crt"] = base64.b64encode(ca).decode()
    names = ["kubernetes://web-cert-cacert"]
    (secret,) = _generate(types.SECRET, _snapshot(with_ca), secret_pb2.Secret, names=names).values()
    assert secret.validation_context.trusted_ca.inline_bytes == ca and not secret.HasField("tls_certificate")
    other_ca = server_credential("x")[0]
    separate = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "web-cert-cacert", "namespace": "istio-ingress"},
                "data": {"cacert": base64.b64encode(other_ca).decode()}}
    (secret,) = _generate(types.SECRET, _snapshot(with_ca, separate), secret_pb2.Secret, names=names).values()
    assert secret.validation_context.trusted_ca.inline_bytes == other_ca
    assert _generate(types.SECRET, _snapshot(), secret_pb2.Secret, names=names) == {}  # no ca.crt anywhere
    bad = {**separate, "data": {"ca.crt": base64.b64encode(b"garbage").decode()}}
    with pytest.raises(ConversionError, match="data.ca.crt: not a PEM certificate chain"):
        convert(bad)


def test_a_server_listens_on_the_target_port_of_the_gateways_service_port() -> None:
    """istiod's resolvePorts: the server's number is a port of the Service whose endpoint the
    gateway's pod is; Envoy listens on its targetPort (a port no Service has stays as written)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ingress-1", "namespace": "istio-ingress", "labels": INGRESS_LABELS},
           "spec": {"containers": [{"name": "istio-proxy", "ports": [{"containerPort": 8444}]}]},
           "status": {"phase": "Running", "podIP": "127.0.0.60", "conditions": [{"type": "Ready", "status": "True"}]}}
    service: dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ingress", "namespace": "istio-ingress"},
               "spec": {"clusterIP": "10.96.0.20", "selector": INGRESS_LABELS,
                        "ports": [{"name": "https", "port": 443, "targetPort": 8444}]}}
    gateway = _l4_gateway({"port": {"number": 443, "name": "https", "protocol": "HTTPS"}, "hosts": ["shop/secure.example.com"],
                           "tls": {"mode": "SIMPLE", "credentialName": "web-cert"}},
                          {"port": {"number": 9000, "name": "tcp", "protocol": "TCP"}, "hosts": ["shop/*"]})
    listeners = _generate(types.LISTENER, _snapshot(gateway, L4_ROUTES, pod, service), listener_pb2.Listener)
    mapped = listeners["127.0.0.60_8444"]
    assert mapped.address.socket_address.port_value == 8444 and "127.0.0.60_443" not in listeners
    assert len(mapped.filter_chains) == 1 and mapped.filter_chains[0].name == "https.8444.https.l4.istio-ingress"
    assert listeners["127.0.0.60_9000"].address.socket_address.port_value == 9000
    opted_out = {**service, "metadata": {**service["metadata"],
                                         "labels": {"networking.istio.io/disable-gateway-port-translation": "true"}}}
    assert "127.0.0.60_443" in _generate(types.LISTENER, _snapshot(gateway, L4_ROUTES, pod, opted_out), listener_pb2.Listener)


def test_istio_mutual_uses_the_mesh_certificate_from_the_agents_sds() -> None:
    gateway = _l4_gateway({"port": {"number": 9443, "name": "mesh", "protocol": "TLS"}, "hosts": ["shop/*.example.com"],
                           "tls": {"mode": "ISTIO_MUTUAL", "subjectAltNames": ["spiffe://cluster.local/ns/shop/sa/client"]}})
    routes = {**L4_ROUTES, "spec": {**L4_ROUTES["spec"], "tcp": [{"route": [{"destination": {"host": "web"}}]}]}}
    snapshot = _snapshot(gateway, routes)
    (chain,) = _generate(types.LISTENER, snapshot, listener_pb2.Listener)["127.0.0.60_9443"].filter_chains
    context = tls_pb2.DownstreamTlsContext.FromString(chain.transport_socket.typed_config.value)
    common = context.common_tls_context
    assert context.require_client_certificate.value
    assert [c.name for c in common.tls_certificate_sds_secret_configs] == ["default"]
    assert common.tls_certificate_sds_secret_configs[0].sds_config.api_config_source.grpc_services[0].envoy_grpc.cluster_name == "sds-grpc"
    validation = common.combined_validation_context
    assert validation.validation_context_sds_secret_config.name == "ROOTCA"
    assert [m.matcher.exact for m in validation.default_validation_context.match_typed_subject_alt_names] == [
        "spiffe://cluster.local/ns/shop/sa/client"]
    assert _tcp_proxy(chain).cluster == WEB_CLUSTER
    # No Secret of the gateway's namespace is involved: nothing is sent by name.
    assert _generate(types.SECRET, snapshot, secret_pb2.Secret, names=["kubernetes://"]) == {}


def test_auto_passthrough_routes_the_sni_of_a_mesh_service_to_its_sni_dnat_cluster() -> None:
    gateway = _l4_gateway({"port": {"number": 15443, "name": "tls", "protocol": "TLS"}, "hosts": ["*.local"],
                           "tls": {"mode": "AUTO_PASSTHROUGH"}})
    rule = {"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule", "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"host": "web.shop.svc.cluster.local", "subsets": [{"name": "v1", "labels": {"version": "v1"}}]}}
    snapshot = _snapshot(gateway, rule)
    listener = _generate(types.LISTENER, snapshot, listener_pb2.Listener)["127.0.0.60_15443"]
    names = {chain.filter_chain_match.server_names[0]: chain for chain in listener.filter_chains}
    assert set(names) == {"outbound_.80_._.web.shop.svc.cluster.local", "outbound_.80_.v1_.web.shop.svc.cluster.local"}
    chain = names["outbound_.80_._.web.shop.svc.cluster.local"]
    assert list(chain.filter_chain_match.application_protocols) == [
        "istio", "istio-peer-exchange", "istio-http/1.0", "istio-http/1.1", "istio-h2"]
    assert not chain.HasField("transport_socket")
    assert _tcp_proxy(chain).cluster == "outbound_.80_._.web.shop.svc.cluster.local"
    clusters = _generate(types.CLUSTER, snapshot, cluster_pb2.Cluster)
    dnat = clusters["outbound_.80_.v1_.web.shop.svc.cluster.local"]
    assert dnat.eds_cluster_config.service_name == "outbound|80|v1|web.shop.svc.cluster.local"
    assert not dnat.HasField("transport_socket") and not dnat.transport_socket_matches
    # Without an AUTO_PASSTHROUGH server, no SNI-DNAT clusters.
    assert not [n for n in _generate(types.CLUSTER, _snapshot(rule), cluster_pb2.Cluster) if n.startswith("outbound_.")]


def test_istio_mutual_ca_crl_joins_the_mesh_validation() -> None:
    """istiod's ApplyToCommonTLSContext: caCrl is the default validation context's CRL file, beside ROOTCA."""
    gateway = _l4_gateway({"port": {"number": 9446, "name": "mesh", "protocol": "HTTPS"}, "hosts": ["shop/secure.example.com"],
                           "tls": {"mode": "ISTIO_MUTUAL", "caCrl": "/etc/istio/crl.pem"}})
    listeners = _generate(types.LISTENER, _snapshot(gateway, L4_ROUTES), listener_pb2.Listener)
    (chain,) = listeners["127.0.0.60_9446"].filter_chains
    combined = tls_pb2.DownstreamTlsContext.FromString(chain.transport_socket.typed_config.value).common_tls_context.combined_validation_context
    assert combined.default_validation_context.crl.filename == "/etc/istio/crl.pem"
    assert combined.validation_context_sds_secret_config.name == "ROOTCA"


def test_a_credential_names_secret_without_its_key_is_not_sent_and_named(caplog: pytest.LogCaptureFixture,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One Secret of credentialNames lacks tls.key: the Secret is refused naming the keys, and the
    other is sent alone, the missing one named in a warning (Envoy's listener waits for it, keeping
    the last good one); no key material logged."""
    gateway = _l4_gateway({"port": {"number": 9443, "name": "two", "protocol": "HTTPS"}, "hosts": ["shop/secure.example.com"],
                           "tls": {"mode": "SIMPLE", "credentialNames": ["web-rsa", "web-cert"]}})
    keyless = tls_secret("web-rsa", "istio-ingress", *CREDENTIAL[1:])
    del keyless["data"]["tls.key"]
    with pytest.raises(ConversionError, match="Secret istio-ingress/web-rsa: data: tls.crt and tls.key must both be set"):
        convert(keyless)
    names = ["kubernetes://web-rsa", "kubernetes://web-cert"]
    monkeypatch.setattr(secrets, "_refused", logs.Throttled(secrets.log, 60.0))  # earlier tests' lines
    with caplog.at_level(logging.WARNING):
        sent = _generate(types.SECRET, _snapshot(gateway), secret_pb2.Secret, names=names)
    assert list(sent) == ["kubernetes://web-cert"]
    assert "without tls.crt/tls.key" in caplog.text and "istio-ingress/web-rsa" in caplog.text
    assert CREDENTIAL[2].decode().splitlines()[1] not in caplog.text


def test_file_certificates_are_the_agents_file_cert_and_file_root_over_sds() -> None:
    """istiod's ApplyToCommonTLSContext with files in the pod: one `file-cert:<cert>~<key>` per
    certificate (tlsCertificates, else serverCertificate/privateKey) and `file-root:<ca>` verifying
    clients, all from the agent's SDS (sds-grpc), so it can watch the files; SANs and CRL as set."""
    gateway = _l4_gateway(
        {"port": {"number": 9443, "name": "simple", "protocol": "HTTPS"}, "hosts": ["shop/secure.example.com"],
         "tls": {"mode": "SIMPLE", "serverCertificate": "/etc/gw/tls.crt", "privateKey": "/etc/gw/tls.key",
                 "minProtocolVersion": "TLSV1_3"}},
        {"port": {"number": 9444, "name": "mutual", "protocol": "TLS"}, "hosts": ["shop/secure.example.com"],
         "tls": {"mode": "MUTUAL", "caCertificates": "/etc/gw/ca.crt", "subjectAltNames": ["client.example.com"],
                 "caCrl": "/etc/gw/ca.crl",
                 "tlsCertificates": [{"serverCertificate": "/etc/gw/rsa.crt", "privateKey": "/etc/gw/rsa.key"},
                                     {"serverCertificate": "/etc/gw/ec.crt", "privateKey": "/etc/gw/ec.key"}]}})
    routes = {**L4_ROUTES, "spec": {**L4_ROUTES["spec"], "tcp": [{"route": [{"destination": {"host": "web"}}]}]}}
    listeners = _generate(types.LISTENER, _snapshot(gateway, routes), listener_pb2.Listener)
    contexts = {port: tls_pb2.DownstreamTlsContext.FromString(
        listeners[f"127.0.0.60_{port}"].filter_chains[0].transport_socket.typed_config.value) for port in (9443, 9444)}
    simple = contexts[9443].common_tls_context
    [certificate] = simple.tls_certificate_sds_secret_configs
    assert certificate.name == "file-cert:/etc/gw/tls.crt~/etc/gw/tls.key"
    assert certificate.sds_config.api_config_source.grpc_services[0].envoy_grpc.cluster_name == "sds-grpc"
    assert not certificate.sds_config.HasField("initial_fetch_timeout")  # Envoy's 15 s, as istiod: a missing file
    assert not simple.HasField("combined_validation_context") and not contexts[9443].require_client_certificate.value
    assert simple.tls_params.tls_minimum_protocol_version == common_pb2.TlsParameters.TLSv1_3
    mutual = contexts[9444].common_tls_context
    assert [c.name for c in mutual.tls_certificate_sds_secret_configs] == [
        "file-cert:/etc/gw/rsa.crt~/etc/gw/rsa.key", "file-cert:/etc/gw/ec.crt~/etc/gw/ec.key"]
    combined = mutual.combined_validation_context
    assert combined.validation_context_sds_secret_config.name == "file-root:/etc/gw/ca.crt"
    assert {m.matcher.exact for m in combined.default_validation_context.match_typed_subject_alt_names} == {
        "client.example.com"}
    assert combined.default_validation_context.crl.filename == "/etc/gw/ca.crl"
    assert contexts[9444].require_client_certificate.value
    # Nothing for istiod to send over ADS: the agent serves these.
    assert _generate(types.SECRET, _snapshot(gateway), secret_pb2.Secret,
                     names=["file-cert:/etc/gw/tls.crt~/etc/gw/tls.key"]) == {}

"""RequestAuthentication -> jwt_authn, and where the sidecar's virtualInbound runs it and RBAC: pure
translation (a real Envoy takes it in test_envoy_authn)."""

from __future__ import annotations

import logging

import pytest
from envoy.extensions.filters.http.jwt_authn.v3 import config_pb2 as jwt_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.protobuf.json_format import MessageToDict

from istiod.model.config.common import Meta
from istiod.model.config.security import (
    Action, AuthorizationPolicy, JWTHeader, JWTRule, MTLSMode, RequestAuthentication, Rule,
)
from istiod.model.protocol import Protocol
from istiod.xds.gen.authn import JWT_FILTER, jwt_filter
from istiod.xds.gen.grpc import _inbound_listener
from istiod.xds.gen.sidecar.listeners import virtual_inbound
from istiod.xds.gen.sidecar.ports import InboundPort

JWKS = '{"keys": []}'


def ra(name: str, *rules: JWTRule) -> RequestAuthentication:
    return RequestAuthentication(Meta(name, "shop"), jwt_rules=rules)


def _config(policies: list[RequestAuthentication]) -> dict:  # type: ignore[type-arg]
    f = jwt_filter(policies)
    assert f is not None and f.name == JWT_FILTER
    config = jwt_pb2.JwtAuthentication()
    assert f.typed_config.Unpack(config)
    return MessageToDict(config)


def test_one_rule_is_istiods_provider_whose_token_must_be_valid_if_present() -> None:
    rule = JWTRule("https://issuer.test", ("web",), JWKS, (JWTHeader("x-jwt", "Token "),), ("access_token",),
                   ("session",), "x-payload", True, (("x-sub", "sub"),))
    config = _config([ra("a", rule)])
    assert config["providers"] == {"origins-0": {
        "issuer": "https://issuer.test", "audiences": ["web"], "localJwks": {"inlineString": JWKS},
        "forward": True, "fromHeaders": [{"name": "x-jwt", "valuePrefix": "Token "}], "fromParams": ["access_token"],
        "fromCookies": ["session"], "forwardPayloadHeader": "x-payload", "payloadInMetadata": "payload",
        "normalizePayloadInMetadata": {"spaceDelimitedClaims": ["permission", "scope"]},
        "claimToHeaders": [{"headerName": "x-sub", "claimName": "sub"}]}}
    assert config["rules"] == [{"match": {"prefix": "/"}, "requires": {"requiresAny": {"requirements": [
        {"providerName": "origins-0"}, {"allowMissing": {}}]}}}]
    assert config["bypassCorsPreflight"] is True
    assert jwt_filter([]) is None and jwt_filter([ra("empty")]) is None


def test_several_rules_sorted_by_issuer_any_valid_token_or_each_valid_or_absent() -> None:
    config = _config([ra("b", JWTRule("https://b.test", jwks=JWKS)), ra("a", JWTRule("https://a.test", jwks=JWKS))])
    assert [config["providers"][f"origins-{i}"]["issuer"] for i in (0, 1)] == ["https://a.test", "https://b.test"]
    each = [{"requiresAny": {"requirements": [{"providerName": f"origins-{i}"}, {"allowMissing": {}}]}} for i in (0, 1)]
    assert config["rules"][0]["requires"] == {"requiresAny": {"requirements": [
        {"providerName": "origins-0"}, {"providerName": "origins-1"}, {"requiresAll": {"requirements": each}}]}}


def test_virtual_inbound_runs_jwt_then_rbac_on_http_and_network_rbac_on_tcp_and_passthrough() -> None:
    policy = AuthorizationPolicy(Meta("web", "shop"), action=Action.DENY, rules=(Rule(),))
    listener = virtual_inbound((InboundPort(8080, Protocol.HTTP), InboundPort(9000, Protocol.TCP)),
                               {0: MTLSMode.PERMISSIVE, 8080: MTLSMode.PERMISSIVE, 9000: MTLSMode.STRICT},
                               (policy,), (ra("web", JWTRule("https://issuer.test", jwks=JWKS)),))
    seen: dict[str, set[tuple[str, ...]]] = {}
    for chain in listener.filter_chains:
        names = [f.name for f in chain.filters]
        if names == ["envoy.filters.network.http_connection_manager"]:
            manager = hcm_pb2.HttpConnectionManager()
            chain.filters[0].typed_config.Unpack(manager)
            names += [f.name for f in manager.http_filters]
        seen.setdefault(chain.name, set()).add(tuple(names))
    http = ("envoy.filters.network.http_connection_manager", JWT_FILTER, "envoy.filters.http.rbac.deny",
            "envoy.filters.http.router")
    tcp = ("envoy.filters.network.rbac", "envoy.filters.network.tcp_proxy")
    assert seen == {
        "virtualInbound-blackhole": {("envoy.filters.network.tcp_proxy",)},
        "virtualInbound-catchall-http": {http}, "virtualInbound": {tcp},  # the ports no service names
        "0.0.0.0_8080": {http}, "0.0.0.0_9000": {tcp},
    }
    assert len([c for c in listener.filter_chains if c.name == "0.0.0.0_9000"]) == 1  # STRICT: no plaintext chain


def test_request_authentication_on_a_proxyless_server_is_said_not_enforced(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        _inbound_listener("xds.istio.io/grpc/lds/inbound/0.0.0.0:7070", "0.0.0.0", 7070, MTLSMode.STRICT, (),
                          (ra("rpc", JWTRule("https://issuer.test", jwks=JWKS)),))
    assert "RequestAuthentication shop/rpc is not enforced on proxyless gRPC servers" in caplog.text

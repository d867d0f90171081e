"""AuthorizationPolicy -> RBAC filter protos (HTTP, TCP, JWT fields), and the inbound mTLS mode, as pure functions."""

from __future__ import annotations

from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as http_rbac_pb2
from envoy.extensions.filters.network.rbac.v3 import rbac_pb2 as network_rbac_pb2
from google.protobuf.json_format import MessageToDict

from istiod.model.config import ConfigSet
from istiod.model.config.common import Meta
from istiod.model.config.security import (
    Action, AuthorizationPolicy, Condition, MTLSMode, Operation, PeerAuthentication, Rule, Source,
)
from istiod.model.mesh import MeshConfig
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds.gen.rbac import NETWORK_RBAC_FILTER, RBAC_FILTER, authorization_filters, tcp_authorization_filters
from istiod.xds.gen.security import authorization_policies, inbound_mtls_mode


def ap(name: str, action: Action = Action.ALLOW, *rules: Rule, namespace: str = "demo") -> AuthorizationPolicy:
    return AuthorizationPolicy(Meta(name, namespace), action=action, rules=rules)


def rules_of(policies: list[AuthorizationPolicy]) -> list[dict]:  # type: ignore[type-arg]
    result = []
    for f in authorization_filters(policies).filters:
        assert f.name in (f"{RBAC_FILTER}.deny", f"{RBAC_FILTER}.allow")
        config = http_rbac_pb2.RBAC()
        assert f.typed_config.Unpack(config)
        result.append(MessageToDict(config.rules))
    return result


def test_deny_then_allow_with_istiods_names_and_matchers() -> None:
    deny = ap("no-echo", Action.DENY, Rule(
        sources=(Source(principals=("cluster.local/ns/demo/sa/client",), not_namespaces=("prod*",)),),
        operations=(Operation(paths=("/demo.Echo/*",), methods=("POST",), ports=(7070,)),),
    ))
    allow = ap("some", Action.ALLOW, Rule(sources=(Source(namespaces=("demo",), ip_blocks=("10.0.0.0/8",)),)),
               Rule(when=(Condition("request.headers[x-user]", ("alice",)),)))
    deny_rules, allow_rules = rules_of([allow, deny])
    assert deny_rules["action"] == "DENY"
    policy = deny_rules["policies"]["ns[demo]-policy[no-echo]-rule[0]"]
    assert policy["principals"] == [{"andIds": {"ids": [
        {"authenticated": {"principalName": {"exact": "spiffe://cluster.local/ns/demo/sa/client"}}},
        {"notId": {"authenticated": {"principalName": {"safeRegex": {"regex": ".*/ns/prod.*/.*"}}}}},
    ]}}]
    assert policy["permissions"] == [{"andRules": {"rules": [
        {"destinationPort": 7070},
        {"header": {"name": ":method", "stringMatch": {"exact": "POST"}}},
        {"urlPath": {"path": {"prefix": "/demo.Echo/"}}},
    ]}}]
    assert allow_rules.get("action", "ALLOW") == "ALLOW"
    assert sorted(allow_rules["policies"]) == ["ns[demo]-policy[some]-rule[0]", "ns[demo]-policy[some]-rule[1]"]
    assert allow_rules["policies"]["ns[demo]-policy[some]-rule[0]"]["principals"][0]["andIds"]["ids"][1] == {
        "directRemoteIp": {"addressPrefix": "10.0.0.0", "prefixLen": 8}}
    assert allow_rules["policies"]["ns[demo]-policy[some]-rule[1]"] == {
        "principals": [{"header": {"name": "x-user", "stringMatch": {"exact": "alice"}}}],
        "permissions": [{"any": True}]}


def test_no_policy_no_filter_and_an_empty_allow_denies_everything() -> None:
    assert authorization_filters([]).filters == ()
    (rules,) = rules_of([ap("nothing")])
    assert rules == {}  # action ALLOW (the default) with no policies: nothing is allowed


def test_unsupported_fields_fail_closed_and_are_reported() -> None:
    jwt = Rule(sources=(Source(request_principals=("issuer/subject",)),))
    hosts = Rule(operations=(Operation(hosts=("example.com",), paths=("/a",)),))
    result = authorization_filters([ap("jwt", Action.ALLOW, jwt), ap("hosts", Action.DENY, hosts),
                                    ap("audit", Action.AUDIT, Rule())])
    (deny_rules, allow_rules) = (MessageToDict(_unpack(f)) for f in result.filters)
    assert allow_rules == {}  # the ALLOW rule needing a JWT is left out: nothing is allowed
    # The DENY rule keeps what can be checked (the path) and denies it whatever the host.
    assert deny_rules["policies"]["ns[demo]-policy[hosts]-rule[0]"]["permissions"] == [
        {"urlPath": {"path": {"exact": "/a"}}}]
    assert result.problems == (
        "AuthorizationPolicy demo/jwt rules[0]: from.source.requestPrincipals (RequestAuthentication) is not "
        "supported; the rule is left out, allowing less",
        "AuthorizationPolicy demo/hosts rules[0]: to.operation.hosts is not supported; ignored, so the rule denies more",
        "AuthorizationPolicy demo/audit: AUDIT is not implemented; the policy has no effect",
    )


def _unpack(f):  # type: ignore[no-untyped-def]
    config = http_rbac_pb2.RBAC()
    f.typed_config.Unpack(config)
    return config.rules


def test_inbound_mode_and_policies_follow_istios_scoping() -> None:
    proxy = Proxy("sidecar~10.0.0.1~a.demo~demo.svc.cluster.local", "sidecar", ("10.0.0.1",), "a", "demo",
                  "demo.svc.cluster.local", "grpc", labels=(("app", "a"),))
    config = ConfigSet(
        peer_authentications=(
            PeerAuthentication(Meta("default", "istio-system"), mode=MTLSMode.STRICT),
            PeerAuthentication(Meta("a", "demo"), (("app", "a"),), MTLSMode.UNSET, ((9090, MTLSMode.DISABLE),)),
        ),
        authorization_policies=(ap("mesh", Action.DENY, Rule(), namespace="istio-system"), ap("local"),
                                ap("other", namespace="other")),
    )
    snapshot = Snapshot("1", config=config)
    assert inbound_mtls_mode(snapshot, proxy, 7070) is MTLSMode.STRICT
    assert inbound_mtls_mode(snapshot, proxy, 9090) is MTLSMode.DISABLE
    bare = Snapshot("1")
    assert inbound_mtls_mode(bare, proxy, 7070) is MTLSMode.PERMISSIVE
    assert inbound_mtls_mode(Snapshot("1", mesh=MeshConfig(mtls=True)), proxy, 7070) is MTLSMode.STRICT
    assert [p.meta.name for p in authorization_policies(snapshot, proxy)] == ["mesh", "local"]


def _network_rules(result) -> list[dict]:  # type: ignore[no-untyped-def, type-arg]
    rules = []
    for f in result.filters:
        assert f.name == NETWORK_RBAC_FILTER
        config = network_rbac_pb2.RBAC()
        assert f.typed_config.Unpack(config)
        assert config.stat_prefix == "tcp."
        rules.append(MessageToDict(config.rules))
    return rules


def test_http_only_fields_on_tcp_chains_follow_istiods_builder() -> None:
    """On a TCP chain an ALLOW rule with an HTTP-only field is left out (allows less); a DENY rule
    ignores the field and keeps the rest (denies more): `ports: [9000], methods: [GET]` denies all of 9000."""
    deny = ap("deny", Action.DENY, Rule(operations=(Operation(ports=(9000,), methods=("GET",)),)),
              Rule(when=(Condition("request.headers[x-user]", ("bob",)),)))
    allow = ap("allow", Action.ALLOW, Rule(sources=(Source(principals=("cluster.local/ns/shop/sa/web",)),)),
               Rule(operations=(Operation(paths=("/public",)),)),
               Rule(sources=(Source(request_principals=("*",)),)))
    result = tcp_authorization_filters([deny, allow])
    deny_rules, allow_rules = _network_rules(result)
    assert deny_rules["policies"] == {
        "ns[demo]-policy[deny]-rule[0]": {"permissions": [{"destinationPort": 9000}], "principals": [{"any": True}]},
        "ns[demo]-policy[deny]-rule[1]": {"permissions": [{"any": True}], "principals": [{"any": True}]},
    }
    assert sorted(allow_rules["policies"]) == ["ns[demo]-policy[allow]-rule[0]"]
    assert result.problems == (
        "AuthorizationPolicy demo/deny rules[0]: to.operation.methods is HTTP only (TCP port); ignored, so the rule "
        "denies more",
        "AuthorizationPolicy demo/deny rules[1]: when.key request.headers[x-user] is HTTP only (TCP port); ignored, "
        "so the rule denies more",
        "AuthorizationPolicy demo/allow rules[1]: to.operation.paths is HTTP only (TCP port); the rule is left out, "
        "allowing less",
        "AuthorizationPolicy demo/allow rules[2]: from.source.requestPrincipals is HTTP only (TCP port); the rule is "
        "left out, allowing less",
    )
    assert tcp_authorization_filters([]).filters == ()


def _jwt_claim(path: list[str], value: dict) -> dict:  # type: ignore[type-arg]
    return {"metadata": {"filter": "envoy.filters.http.jwt_authn",
                         "path": [{"key": k} for k in ("payload", *path)], "value": value}}


def _claim_value(exact: str) -> dict:  # type: ignore[type-arg]
    return {"orMatch": {"valueMatchers": [{"listMatch": {"oneOf": {"stringMatch": {"exact": exact}}}},
                                          {"stringMatch": {"exact": exact}}]}}


def test_request_principals_and_claims_read_the_jwt_payload_where_jwt_authn_runs() -> None:
    rule = Rule(sources=(Source(request_principals=("https://issuer.test/path/alice",),
                                not_request_principals=("*",)),),
                when=(Condition("request.auth.claims[groups]", ("admins",)),
                      Condition("request.auth.claims[realm][role]", ("ops",)),
                      Condition("request.auth.audiences", ("web",)),
                      Condition("request.auth.presenter", ("cli",)),
                      Condition("request.auth.principal", ("iss/*",))))
    (rules,) = (MessageToDict(_unpack(f)) for f in authorization_filters([ap("jwt", Action.ALLOW, rule)],
                                                                           request_auth=True).filters)
    source, *conditions = rules["policies"]["ns[demo]-policy[jwt]-rule[0]"]["principals"][0]["andIds"]["ids"]
    any_ = {"safeRegex": {"regex": ".+"}}
    # The request principal `<iss>/<sub>` splits at the last `/`: the issuer is a URL.
    assert source["andIds"]["ids"] == [
        {"andIds": {"ids": [_jwt_claim(["iss"], {"stringMatch": {"exact": "https://issuer.test/path"}}),
                            _jwt_claim(["sub"], {"stringMatch": {"exact": "alice"}})]}},
        {"notId": {"andIds": {"ids": [_jwt_claim(["iss"], {"stringMatch": any_}),
                                      _jwt_claim(["sub"], {"stringMatch": any_})]}}}]
    assert conditions[0] == _jwt_claim(["groups"], _claim_value("admins"))
    assert conditions[1] == _jwt_claim(["realm", "role"], _claim_value("ops"))
    assert conditions[2] == _jwt_claim(["aud"], _claim_value("web"))
    assert conditions[3] == _jwt_claim(["azp"], _claim_value("cli"))
    assert conditions[4] == {"andIds": {"ids": [_jwt_claim(["iss"], {"stringMatch": {"exact": "iss"}}),
                                                _jwt_claim(["sub"], {"stringMatch": any_})]}}

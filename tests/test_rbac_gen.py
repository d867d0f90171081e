"""AuthorizationPolicy -> RBAC filter protos, and the inbound mTLS mode, as pure functions."""

from __future__ import annotations

from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as http_rbac_pb2
from google.protobuf.json_format import MessageToDict

from istiod.model.config import ConfigSet
from istiod.model.config.common import Meta
from istiod.model.config.security import (
    Action, AuthorizationPolicy, Condition, MTLSMode, Operation, PeerAuthentication, Rule, Source,
)
from istiod.model.mesh import MeshConfig
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds.gen.rbac import RBAC_FILTER, authorization_filters
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

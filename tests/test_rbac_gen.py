"""AuthorizationPolicy -> RBAC filter protos (HTTP, TCP, JWT fields), and the inbound mTLS mode, as pure functions."""

from __future__ import annotations

from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as http_rbac_pb2
from envoy.extensions.filters.network.rbac.v3 import rbac_pb2 as network_rbac_pb2
from google.protobuf.json_format import MessageToDict

from istiod.model.config import ConfigSet
from istiod.model.config.common import Meta
from istiod.model.config.security import (
    Action, AuthorizationPolicy, Condition, MTLSMode, Operation, PeerAuthentication, Rule, Source,
)
from istiod.model.mesh import ExtAuthzProvider, MeshConfig
from istiod.model.service import Port, Service
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds.gen.extauthz import resolve_providers
from istiod.xds.gen.rbac import (
    NETWORK_RBAC_FILTER, RBAC_FILTER, authorization_filters, custom_providers, tcp_authorization_filters,
)
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
    template = Rule(operations=(Operation(paths=("/a/{*}/b", "/a"),),))
    sni = Rule(when=(Condition("connection.sni", ("x.example.com",)),))
    result = authorization_filters([ap("jwt", Action.ALLOW, jwt), ap("tpl", Action.DENY, template),
                                    ap("sni", Action.ALLOW, sni), ap("audit", Action.AUDIT, Rule())],
                                   proxyless=True)
    (deny_rules, allow_rules) = (MessageToDict(_unpack(f)) for f in result.filters)
    assert allow_rules == {}  # the ALLOW rules gRPC cannot check are left out: nothing is allowed
    # The DENY rule keeps what gRPC can check (the plain path) and denies it.
    assert deny_rules["policies"]["ns[demo]-policy[tpl]-rule[0]"]["permissions"] == [
        {"urlPath": {"path": {"exact": "/a"}}}]
    assert result.problems == (
        "AuthorizationPolicy demo/audit: AUDIT is not supported by proxyless gRPC; the policy has no effect",
        "AuthorizationPolicy demo/tpl rules[0]: to.operation.paths with a template ({*} or {**}) is not supported by "
        "proxyless gRPC; ignored, so the rule denies more",
        "AuthorizationPolicy demo/jwt rules[0]: from.source.requestPrincipals (RequestAuthentication) is not "
        "supported; the rule is left out, allowing less",
        "AuthorizationPolicy demo/sni rules[0]: when.key connection.sni is not supported by proxyless gRPC; the rule "
        "is left out, allowing less",
    )


def _config(f):  # type: ignore[no-untyped-def]
    config = http_rbac_pb2.RBAC()
    assert f.typed_config.Unpack(config)
    return MessageToDict(config)


def test_envoy_matchers_hosts_templates_sni_metadata_and_service_accounts() -> None:
    rule = Rule(
        sources=(Source(service_accounts=("web", "other/api")),),
        operations=(Operation(hosts=("*.example.com", "A.test"), not_hosts=("*",), paths=("/a/{*}/b/{**}",)),),
        when=(Condition("connection.sni", ("sni.example.com",)),
              Condition("experimental.envoy.filters.network.mysql_proxy[db.table]", ("[update]", "x*")),
              Condition("source.serviceAccount", not_values=("ns2/sa",))))
    (allow,) = authorization_filters([ap("all", Action.ALLOW, rule)], request_auth=True).filters
    policy = _config(allow)["rules"]["policies"]["ns[demo]-policy[all]-rule[0]"]
    sa = "spiffe://.+/ns/{}/(.+/|)sa/{}(/.+)?"
    assert policy["principals"] == [{"andIds": {"ids": [
        {"orIds": {"ids": [{"authenticated": {"principalName": {"safeRegex": {"regex": sa.format("demo", "web")}}}},
                           {"authenticated": {"principalName": {"safeRegex": {"regex": sa.format("other", "api")}}}}]}},
        {"notId": {"authenticated": {"principalName": {"safeRegex": {"regex": sa.format("ns2", "sa")}}}}},
    ]}}]
    assert policy["permissions"] == [{"andRules": {"rules": [{"andRules": {"rules": [
        {"uriTemplate": {"name": "uri-template", "typedConfig": {
            "@type": "type.googleapis.com/envoy.extensions.path.match.uri_template.v3.UriTemplateMatchConfig",
            "pathTemplate": "/a/*/b/**"}}},
        {"orRules": {"rules": [
            {"header": {"name": ":authority", "stringMatch": {"suffix": ".example.com", "ignoreCase": True}}},
            {"header": {"name": ":authority", "stringMatch": {"exact": "A.test", "ignoreCase": True}}}]}},
        {"notRule": {"header": {"name": ":authority", "presentMatch": True}}}]}},
        {"requestedServerName": {"exact": "sni.example.com"}},
        {"metadata": {"filter": "envoy.filters.network.mysql_proxy", "path": [{"key": "db.table"}],
                      "value": {"orMatch": {"valueMatchers": [
                          {"listMatch": {"oneOf": {"stringMatch": {"exact": "update"}}}},
                          {"stringMatch": {"prefix": "x"}}]}}}},
    ]}}]


def _provider(name: str, service: str = "authz.demo.svc.cluster.local", grpc: bool = False) -> ExtAuthzProvider:
    return ExtAuthzProvider(name, grpc, service, 8000, timeout=0.5, headers_to_upstream_on_allow=("x-ext-*",))


def test_audit_logs_and_custom_runs_ext_authz_after_a_shadow_rbac_as_istio() -> None:
    authz_service = Service("authz", "demo", "cluster.local", (Port("http", 8000, "HTTP"),))
    snapshot = Snapshot("1", services={authz_service.hostname: authz_service},
                        mesh=MeshConfig(extension_providers=(_provider("ext"), _provider("lost", "gone.demo.svc"))))
    custom = AuthorizationPolicy(Meta("ext", "demo"), action=Action.CUSTOM, provider="ext",
                                 rules=(Rule(operations=(Operation(paths=("/private/*",)),)),))
    audit = ap("audit", Action.AUDIT, Rule(operations=(Operation(methods=("DELETE",)),)))
    providers = resolve_providers(snapshot, custom_providers([custom]))
    result = authorization_filters([audit, custom], providers=providers)
    assert [f.name for f in result.filters] == [f"{RBAC_FILTER}.custom", "envoy.filters.http.ext_authz",
                                                f"{RBAC_FILTER}.log"]
    shadow, ext, log = result.filters
    assert _config(shadow) == {"shadowRulesStatPrefix": "istio_ext_authz_", "shadowRules": {"action": "DENY", "policies": {
        "istio-ext-authz-ext-ns[demo]-policy[ext]-rule[0]": {
            "permissions": [{"urlPath": {"path": {"prefix": "/private/"}}}], "principals": [{"any": True}]}}}}
    config = ext_authz_pb2.ExtAuthz()
    assert ext.typed_config.Unpack(config)
    assert MessageToDict(config) == {
        "httpService": {"serverUri": {"uri": "http://authz.demo.svc.cluster.local",
                                      "cluster": "outbound|8000||authz.demo.svc.cluster.local", "timeout": "0.500s"},
                        "authorizationResponse": {"allowedUpstreamHeaders": {"patterns": [
                            {"prefix": "x-ext-", "ignoreCase": True}]}}},
        "transportApiVersion": "V3",
        "filterEnabledMetadata": {"filter": "envoy.filters.http.rbac",
                                  "path": [{"key": "istio_ext_authz_shadow_effective_policy_id"}],
                                  "value": {"stringMatch": {"prefix": "istio-ext-authz-ext"}}},
    }
    assert _config(log)["rules"]["action"] == "LOG"
    assert result.problems == ()
    # An HTTP provider has no TCP filter (as istiod); AUDIT logs connections.
    assert [f.name for f in tcp_authorization_filters([audit, custom], providers).filters] == [NETWORK_RBAC_FILTER]
    # A gRPC provider: the filter calls it over gRPC, and TCP chains get the network filters too.
    grpc_snapshot = Snapshot("1", services={authz_service.hostname: authz_service},
                             mesh=MeshConfig(extension_providers=(_provider("ext", grpc=True),)))
    grpc_providers = resolve_providers(grpc_snapshot, ["ext"])
    config = ext_authz_pb2.ExtAuthz()
    assert authorization_filters([custom], providers=grpc_providers).filters[1].typed_config.Unpack(config)
    assert MessageToDict(config)["grpcService"] == {
        "envoyGrpc": {"clusterName": "outbound|8000||authz.demo.svc.cluster.local",
                      "authority": "authz.demo.svc.cluster.local"}, "timeout": "0.500s"}
    assert [f.name for f in tcp_authorization_filters([custom], grpc_providers).filters] == [
        NETWORK_RBAC_FILTER, "envoy.filters.network.ext_authz"]
    # A provider whose service is not in the registry, or that mesh config does not name, denies.
    for name, error in (("lost", "could not find service gone.demo.svc in Istio service registry"),
                        ("nobody", "available providers are ['ext', 'lost'] but found 'nobody'")):
        bad = AuthorizationPolicy(Meta("bad", "demo"), action=Action.CUSTOM, provider=name, rules=(Rule(),))
        result = authorization_filters([bad], providers=resolve_providers(snapshot, [name]))
        (deny,) = result.filters
        assert _config(deny)["rules"] == {"action": "DENY", "policies": {
            f"istio-ext-authz-{name}-ns[demo]-policy[bad]-rule[0]-deny-due-to-bad-CUSTOM-action": {
                "permissions": [{"any": True}], "principals": [{"any": True}]}}}
        assert result.problems == (f"CUSTOM provider {name!r} of AuthorizationPolicy demo/bad: {error}; its rules deny",)


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

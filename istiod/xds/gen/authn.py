"""RequestAuthentication -> Envoy's JWT filter (envoy.extensions.filters.http.jwt_authn.v3), as
istiod's policy applier builds it for a workload's inbound HTTP chains. Pure.

Every JWT rule of the RequestAuthentications selecting a workload is one provider `origins-<i>`
(rules sorted by issuer). A request without a token passes (an AuthorizationPolicy asking for
requestPrincipals then refuses it with 403); a token that is present but invalid (signature,
expiry, issuer, audience) is refused with 401. The verified payload goes to dynamic metadata under
`payload`, where the RBAC filters' requestPrincipals and `request.auth.*` matchers read it.
Proxyless gRPC has no JWT filter: RequestAuthentication does not apply there (istiod's gRPC
generator leaves it out too).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.jwt_authn.v3 import config_pb2 as jwt_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.type.matcher.v3 import metadata_pb2, string_pb2, value_pb2
from google.protobuf import empty_pb2

from istiod.model.config.security import JWTRule, RequestAuthentication
from istiod.xds.gen.filters import pack

JWT_FILTER = "envoy.filters.http.jwt_authn"
JWT_PAYLOAD = "payload"  # the dynamic metadata key of the verified payload, istiod's
_SPACE_DELIMITED_CLAIMS = ("permission", "scope")  # istiod's defaults: matched word by word


# What a jwksUri istiod could not fetch serves, as istiod: an RSA public key whose private key was
# generated and thrown away at once, so no token verifies (fail closed).
PUBLIC_ONLY_JWKS = json.dumps({"keys": [{"kty": "RSA", "e": "AQAB", "n": (
    "rxBkCEEP-8gPvrfrHhEowp6z7M1-IzDqAJqP75J71uSiS4YmrTB8OAtMfUdYZEo0NTFNRaChmVLCG4mscVl302yOz9AZpKSqy_hi3B9y2ibx"
    "iMtxzprGzqQfuj2FuvCCCsa4lYJL5l0FrN23rr8INbtxH8B7iJy0tVnC-UZxWU9ZndZdDVhwlrSesv5PtYq0PnL01q8quWVSLiqbtG2vip1p"
    "VwZyS02R6aRd8rQlTS8NgiA_OIh-ava0jsgxyOj9YicHY25CsG8pED0NMclbGaKapFnMlkOykk41WIyvBGJeIJ8EyWEv1NqnF85YsrcpyQq3"
    "wdEkpRQxPGBWFFS3wQ")}]})


OPENID_DISCOVERY = "/.well-known/openid-configuration"


def jwks_source(rule: JWTRule) -> str:
    """Where istiod fetches a rule's keys: its jwksUri, else the issuer's OpenID discovery document
    (whose `jwks_uri` names them)."""
    return rule.jwks_uri or rule.issuer + OPENID_DISCOVERY


def jwks_for(rule: JWTRule, fetched: Mapping[str, str]) -> str:
    """The keys Envoy checks tokens with: inline, else what istiod fetched, else none."""
    return rule.jwks or fetched.get(jwks_source(rule)) or PUBLIC_ONLY_JWKS


def jwt_filter(policies: Iterable[RequestAuthentication], fetched: Mapping[str, str] | None = None,
               clear_route_cache: bool = False) -> hcm_pb2.HttpFilter | None:
    """The JWT filter for the RequestAuthentications that apply to a workload, or None;
    `fetched`: the JSON Web Key Sets istiod fetched, by jwksUri. `clear_route_cache` (istiod's, on
    every proxy but sidecars): the route is picked again once the token is verified, so a
    VirtualService can route by its claims."""
    rules = sorted((rule for policy in policies for rule in policy.jwt_rules), key=lambda r: r.issuer)
    if not rules:
        return None
    Requirement = jwt_pb2.JwtRequirement
    providers: dict[str, jwt_pb2.JwtProvider] = {}
    each: list[jwt_pb2.JwtRequirement] = []  # per provider: its token is valid, or absent
    any_: list[jwt_pb2.JwtRequirement] = []  # per provider: its token is valid
    for i, rule in enumerate(rules):
        name = f"origins-{i}"
        providers[name] = _provider(rule, jwks_for(rule, fetched or {}), clear_route_cache)
        each.append(Requirement(requires_any=jwt_pb2.JwtRequirementOrList(requirements=[
            Requirement(provider_name=name), Requirement(allow_missing=empty_pb2.Empty())])))
        any_.append(Requirement(provider_name=name))
    # One provider: its token, if any, must be valid. More: one provider's valid token, or every
    # provider's token valid or absent (the first saves tokens that several providers read from one header).
    requires = each[0] if len(each) == 1 else Requirement(requires_any=jwt_pb2.JwtRequirementOrList(
        requirements=[*any_, Requirement(requires_all=jwt_pb2.JwtRequirementAndList(requirements=each))]))
    config = jwt_pb2.JwtAuthentication(
        providers=providers,
        rules=[jwt_pb2.RequirementRule(match=route_components_pb2.RouteMatch(prefix="/"), requires=requires)],
        bypass_cors_preflight=True,
    )
    return hcm_pb2.HttpFilter(name=JWT_FILTER, typed_config=pack(config))


def _provider(rule: JWTRule, jwks: str, clear_route_cache: bool) -> jwt_pb2.JwtProvider:
    return jwt_pb2.JwtProvider(
        clear_route_cache=clear_route_cache,
        issuer=rule.issuer,
        audiences=rule.audiences,
        forward=rule.forward_original_token,
        forward_payload_header=rule.output_payload_to_header,
        payload_in_metadata=JWT_PAYLOAD,
        normalize_payload_in_metadata=jwt_pb2.JwtProvider.NormalizePayload(
            space_delimited_claims=_SPACE_DELIMITED_CLAIMS),
        claim_to_headers=[jwt_pb2.JwtClaimToHeader(header_name=header, claim_name=claim)
                          for header, claim in rule.output_claim_to_headers],
        from_headers=[jwt_pb2.JwtHeader(name=h.name, value_prefix=h.prefix) for h in rule.from_headers],
        from_params=rule.from_params,
        from_cookies=rule.from_cookies,
        local_jwks=base_pb2.DataSource(inline_string=jwks),
    )


def payload_matcher(claim: Sequence[str], value: value_pb2.ValueMatcher, invert: bool = False) -> metadata_pb2.MetadataMatcher:
    """A claim of the token jwt_authn verified: its payload, in dynamic metadata under `payload`."""
    return metadata_pb2.MetadataMatcher(
        filter=JWT_FILTER, invert=invert, value=value,
        path=[metadata_pb2.MetadataMatcher.PathSegment(key=k) for k in (JWT_PAYLOAD, *claim)])


def string_or_list(string: string_pb2.StringMatcher) -> value_pb2.ValueMatcher:
    """A claim that is a string matching, or a list holding one (`aud`, `groups`): istiod's claim match."""
    return value_pb2.ValueMatcher(or_match=value_pb2.OrMatcher(value_matchers=[
        value_pb2.ValueMatcher(list_match=value_pb2.ListMatcher(one_of=value_pb2.ValueMatcher(string_match=string))),
        value_pb2.ValueMatcher(string_match=string)]))

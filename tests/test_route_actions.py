"""Route actions and client TLS, translated: header operations, rewrites, redirects and direct
responses for Envoy (and what proxyless gRPC is sent instead), DestinationRule SIMPLE/MUTUAL TLS.
Model in, protos out; tests/test_envoy_routing.py proves the same with a real Envoy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2

from istiod.model.builder import build_snapshot
from istiod.model.config.networking import Retries
from istiod.model.proxy import proxy_from_node
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import PROXYLESS_GRPC, SIDECAR
from istiod.xds.gen.routes import retry_policy

DATA = Path(__file__).parent / "data"
WEB = "web.shop.svc.cluster.local"
NODE = "sidecar~127.0.0.31~web-1.shop~shop.svc.cluster.local"
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
APPEND = base_pb2.HeaderValueOption.APPEND_IF_EXISTS_OR_ADD

ROUTES = """
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: web, namespace: shop}
spec:
  hosts: [web]
  http:
  - name: moved
    match: [{uri: {prefix: /old}}]
    redirect: {uri: /new, authority: new.example, derivePort: FROM_REQUEST_PORT, redirectCode: 302}
  - name: moved-prefix
    match: [{uri: {prefix: /older/}}]
    redirect: {prefixRewrite: /newer/}
  - name: gone
    match: [{uri: {prefix: /gone}}]
    directResponse: {status: 410, body: {string: "gone\\n"}}
    headers: {response: {set: {x-why: retired}}}
  - name: rewritten
    match: [{uri: {prefix: /v1/}}]
    rewrite: {uri: /api/}
    headers:
      request: {set: {x-b: "1", x-a: "2"}, add: {x-c: "3"}, remove: [x-secret]}
      response: {add: {x-served-by: web}, remove: [server]}
    route:
    - destination: {host: web}
      headers: {request: {set: {":authority": dest.example, x-d: "4"}}}
  - name: regex
    match: [{uri: {prefix: /r/}}]
    rewrite: {uriRegexRewrite: {match: "^/r/(.*)$", rewrite: "/\\\\1"}, authority: rewritten.example}
    route: [{destination: {host: web}, headers: {request: {set: {host: not-this.example}}}}]
  - name: split
    route:
    - destination: {host: web}
      weight: 90
      headers: {request: {add: {x-side: big}, set: {host: big.example}}}
    - destination: {host: web}
      weight: 10
"""


def _snapshot(extra: str) -> Any:
    store = Store()
    for document in [*yaml.safe_load_all((DATA / "sidecar-mesh.yaml").read_text()), *yaml.safe_load_all(extra)]:
        store.apply(document)
    return build_snapshot(store, "v1")


def _sidecar(type_url: str, extra: str, message: Any) -> dict[str, Any]:
    resources = SIDECAR[type_url](_snapshot(extra), proxy_from_node(NODE, {}), None, ResourceCache())
    return {r.name: message.FromString(r.value) for r in resources}


def _web_routes(config: route_pb2.RouteConfiguration) -> dict[str, route_components_pb2.Route]:
    host = next(h for h in config.virtual_hosts if h.name == f"{WEB}:80")
    return {r.name: r for r in host.routes}


def _headers(options: Any) -> list[tuple[str, str, int]]:
    return [(o.header.key, o.header.value, o.append_action) for o in options]


def test_sidecar_routes_carry_istiods_header_operations_rewrites_and_actions() -> None:
    routes = _web_routes(_sidecar(types.ROUTE, ROUTES, route_pb2.RouteConfiguration)["80"])
    moved = routes["moved"].redirect
    assert (moved.path_redirect, moved.host_redirect, moved.response_code) == (
        "/new", "new.example", route_components_pb2.RedirectAction.FOUND)
    assert moved.port_redirect == 0  # the request's port is 80: http's default, left out
    prefixed = routes["moved-prefix"].redirect
    assert (prefixed.prefix_rewrite, prefixed.path_redirect, prefixed.response_code) == (
        "/newer/", "", route_components_pb2.RedirectAction.MOVED_PERMANENTLY)
    gone = routes["gone"]
    assert (gone.direct_response.status, gone.direct_response.body.inline_string) == (410, "gone\n")
    assert _headers(gone.response_headers_to_add) == [("x-why", "retired", OVERWRITE)]

    rewritten = routes["rewritten"]
    # The route's `set` (by name), its `add`, then the single destination's; the authority is a rewrite.
    assert _headers(rewritten.request_headers_to_add) == [
        ("x-a", "2", OVERWRITE), ("x-b", "1", OVERWRITE), ("x-c", "3", APPEND), ("x-d", "4", OVERWRITE)]
    assert list(rewritten.request_headers_to_remove) == ["x-secret"]
    assert _headers(rewritten.response_headers_to_add) == [("x-served-by", "web", APPEND)]
    assert list(rewritten.response_headers_to_remove) == ["server"]
    assert rewritten.route.prefix_rewrite == "/api/"
    assert rewritten.route.host_rewrite_literal == "dest.example"

    regex = routes["regex"].route
    assert (regex.regex_rewrite.pattern.regex, regex.regex_rewrite.substitution) == ("^/r/(.*)$", "/\\1")
    assert regex.host_rewrite_literal == "rewritten.example"  # rewrite.authority over the destination's
    assert not routes["regex"].request_headers_to_add  # the authority is never a header to add

    big, small = routes["split"].route.weighted_clusters.clusters
    assert (big.weight.value, _headers(big.request_headers_to_add), big.host_rewrite_literal) == (
        90, [("x-side", "big", APPEND)], "big.example")
    assert not small.request_headers_to_add and not small.HasField("host_rewrite_literal")
    assert not routes["split"].route.HasField("host_rewrite_literal")


def test_proxyless_routes_leave_out_what_grpc_ignores() -> None:
    """gRPC ignores header operations and rewrites (istiod sends them all the same); a redirect or
    direct response is an action gRPC fails the call on, as under istiod."""
    proxy = proxy_from_node(NODE, {"GENERATOR": "grpc"})
    name = f"outbound|80||{WEB}"
    resources = PROXYLESS_GRPC[types.ROUTE](_snapshot(ROUTES), proxy, [name], ResourceCache())
    routes = {r.name: r for r in route_pb2.RouteConfiguration.FromString(resources[0].value).virtual_hosts[0].routes}
    for route in routes.values():
        assert not (route.request_headers_to_add or route.request_headers_to_remove
                    or route.response_headers_to_add or route.response_headers_to_remove)
        assert not (route.route.prefix_rewrite or route.route.HasField("regex_rewrite")
                    or route.route.HasField("host_rewrite_literal"))
        assert not any(c.request_headers_to_add or c.HasField("host_rewrite_literal")
                       for c in route.route.weighted_clusters.clusters)
    assert routes["moved"].HasField("redirect") and routes["gone"].HasField("direct_response")
    assert routes["rewritten"].route.cluster == name


CLAIM_ROUTES = """
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: web, namespace: shop}
spec:
  hosts: [web]
  http:
  - name: admins
    match: [{headers: {"@request.auth.claims.groups": {exact: admins}, x-a: {prefix: b}}}]
    route: [{destination: {host: web}}]
  - name: not-nested
    match: [{withoutHeaders: {"@request.auth.claims[org][team]": {prefix: ops}}}]
    route: [{destination: {host: web}}]
  - name: rest
    route: [{destination: {host: web}}]
"""


def test_a_header_match_on_a_jwt_claim_matches_the_verified_payload() -> None:
    """`@request.auth.claims.<name>` (or `[a][b]`) is istiod's claim-based routing: a match on what
    jwt_authn left in dynamic metadata, a string claim or a list holding the value."""
    routes = _web_routes(_sidecar(types.ROUTE, CLAIM_ROUTES, route_pb2.RouteConfiguration)["80"])
    admins = routes["admins"].match
    assert [h.name for h in admins.headers] == ["x-a"]
    (claim,) = admins.dynamic_metadata
    assert (claim.filter, [p.key for p in claim.path], claim.invert) == (
        "envoy.filters.http.jwt_authn", ["payload", "groups"], False)
    in_list, string = claim.value.or_match.value_matchers
    assert in_list.list_match.one_of.string_match.exact == string.string_match.exact == "admins"
    (nested,) = routes["not-nested"].match.dynamic_metadata
    assert ([p.key for p in nested.path], nested.invert) == (["payload", "org", "team"], True)
    assert not routes["not-nested"].match.headers
    # gRPC verifies no token: those matches are left out for proxyless clients.
    proxy = proxy_from_node(NODE, {"GENERATOR": "grpc"})
    resources = PROXYLESS_GRPC[types.ROUTE](_snapshot(CLAIM_ROUTES), proxy, [f"outbound|80||{WEB}"], ResourceCache())
    assert [r.name for r in route_pb2.RouteConfiguration.FromString(resources[0].value).virtual_hosts[0].routes] == [
        "rest"]


def _rule(tls: str) -> str:
    return f"""
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {{name: web, namespace: shop}}
spec:
  host: web
  trafficPolicy: {{tls: {tls}}}
"""


def _web_cluster(tls: str) -> cluster_pb2.Cluster:
    return _sidecar(types.CLUSTER, _rule(tls), cluster_pb2.Cluster)[f"outbound|80||{WEB}"]


def _upstream(cluster: cluster_pb2.Cluster) -> tls_pb2.UpstreamTlsContext:
    assert not cluster.transport_socket_matches
    context = tls_pb2.UpstreamTlsContext()
    cluster.transport_socket.typed_config.Unpack(context)
    return context


def _auto(cluster: cluster_pb2.Cluster) -> tuple[bool, bool]:
    options = http_protocol_options_pb2.HttpProtocolOptions()
    cluster.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].Unpack(options)
    upstream = options.upstream_http_protocol_options
    return upstream.auto_sni, upstream.auto_san_validation


def test_simple_tls_trusts_the_named_ca_and_takes_sni_and_san_from_the_host() -> None:
    cluster = _web_cluster("{mode: SIMPLE, caCertificates: /etc/certs/ca.pem}")
    context = _upstream(cluster)
    validation = context.common_tls_context.validation_context
    assert validation.trusted_ca.filename == "/etc/certs/ca.pem"
    assert not context.sni and not context.common_tls_context.tls_certificates
    assert _auto(cluster) == (True, True)  # istiod's auto SNI and SAN check, from the request's Host


def test_simple_tls_without_a_ca_uses_the_systems_and_names_its_sni_and_sans() -> None:
    cluster = _web_cluster("{mode: SIMPLE, sni: api.example.com, subjectAltNames: [api.example.com]}")
    context = _upstream(cluster)
    validation = context.common_tls_context.validation_context
    assert validation.trusted_ca.filename == "/etc/ssl/certs/ca-certificates.crt"
    assert context.sni == "api.example.com"
    assert [(m.san_type, m.matcher.exact) for m in validation.match_typed_subject_alt_names] == [
        (common_pb2.SubjectAltNameMatcher.DNS, "api.example.com"),
        (common_pb2.SubjectAltNameMatcher.URI, "api.example.com")]
    assert _auto(cluster) == (False, False)


def test_mutual_tls_presents_the_named_certificate_and_insecure_skip_verify_checks_nothing() -> None:
    cluster = _web_cluster("{mode: MUTUAL, clientCertificate: /c/cert.pem, privateKey: /c/key.pem, "
                           "insecureSkipVerify: true}")
    context = _upstream(cluster)
    (certificate,) = context.common_tls_context.tls_certificates
    assert (certificate.certificate_chain.filename, certificate.private_key.filename) == ("/c/cert.pem", "/c/key.pem")
    assert not context.common_tls_context.HasField("validation_context")
    assert _auto(cluster) == (True, False)


def test_tls_origination_to_a_tcp_port_has_no_http_options() -> None:
    rule = _rule("{mode: SIMPLE, sni: db.example}").replace("host: web", "host: db")
    cluster = _sidecar(types.CLUSTER, rule, cluster_pb2.Cluster)["outbound|5432||db.shop.svc.cluster.local"]
    assert _upstream(cluster).sni == "db.example"
    assert not cluster.typed_extension_protocol_options


def test_retries_as_istio_converts_them() -> None:
    """No status code is retriable by default (current Istio); a consistent-hashed destination
    retries on the same endpoint; retryRemoteLocalities moves a retry to the next priority."""
    default = retry_policy(None)
    assert default is not None and not default.retriable_status_codes
    assert [p.name for p in default.retry_host_predicate] == ["envoy.retry_host_predicates.previous_hosts"]
    hashed = retry_policy(None, hashed=True)
    assert hashed is not None and not hashed.retry_host_predicate
    remote = retry_policy(Retries(3, retry_remote_localities=True, retry_ignore_previous_hosts=True), hashed=True)
    assert remote is not None and remote.retry_priority.name == "envoy.retry_priorities.previous_priorities"
    assert [p.name for p in remote.retry_host_predicate] == ["envoy.retry_host_predicates.previous_hosts"]

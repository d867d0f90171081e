"""meshConfig extensionProviders (envoyExtAuthzHttp, envoyExtAuthzGrpc) -> Envoy's ext_authz
filters, as istiod's authz builder makes them for AuthorizationPolicies with action CUSTOM. Pure.

The filter runs only when the shadow RBAC filter before it matched a CUSTOM rule of its
provider (dynamic metadata `istio_ext_authz_shadow_effective_policy_id` starting with
`istio-ext-authz-<provider>`); the provider's service is reached through its outbound cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2, config_source_pb2, grpc_service_pb2, http_uri_pb2
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2 as http_ext_authz_pb2
from envoy.extensions.filters.network.ext_authz.v3 import ext_authz_pb2 as network_ext_authz_pb2
from envoy.type.matcher.v3 import metadata_pb2, string_pb2, value_pb2
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2

from istiod.model.mesh import ExtAuthzProvider
from istiod.model.names import outbound_cluster_name
from istiod.model.snapshot import Snapshot

EXT_AUTHZ_FILTER = "envoy.filters.http.ext_authz"
NETWORK_EXT_AUTHZ_FILTER = "envoy.filters.network.ext_authz"
EXT_AUTHZ_MATCH_PREFIX = "istio-ext-authz"
SHADOW_STAT_PREFIX = "istio_ext_authz_"  # the shadow RBAC's stat and metadata prefix
_DEFAULT_TIMEOUT = 600  # seconds, istiod's


@dataclass(frozen=True, slots=True)
class ResolvedProvider:
    """A provider with its service found in the registry (`error` says why it was not)."""

    provider: ExtAuthzProvider | None
    hostname: str = ""
    error: str = ""

    @property
    def cluster(self) -> str:
        assert self.provider is not None
        return outbound_cluster_name(self.provider.port, self.hostname)


def resolve_providers(snapshot: Snapshot, names: Sequence[str]) -> dict[str, ResolvedProvider]:
    """The named providers as istiod's LookupCluster finds them: `[namespace/]host` must be the
    hostname of a service in the registry."""
    known = {p.name: p for p in snapshot.mesh.extension_providers}
    result = {}
    for name in names:
        provider = known.get(name)
        if provider is None:
            result[name] = ResolvedProvider(None, error=f"available providers are {sorted(known)} but found {name!r}")
            continue
        namespace, _, host = provider.service.rpartition("/")
        service = snapshot.services.get(host)  # the exact hostname, as istiod's service index
        if service is None or (namespace and service.namespace != namespace):
            result[name] = ResolvedProvider(
                provider, error=f"could not find service {provider.service} in Istio service registry")
        else:
            result[name] = ResolvedProvider(provider, service.hostname)
    return result


def filter_enabled(rbac_filter: str, provider: str) -> metadata_pb2.MetadataMatcher:
    """Run only when the shadow RBAC matched one of `provider`'s rules."""
    return metadata_pb2.MetadataMatcher(
        filter=rbac_filter,
        path=[metadata_pb2.MetadataMatcher.PathSegment(key=SHADOW_STAT_PREFIX + "shadow_effective_policy_id")],
        value=value_pb2.ValueMatcher(string_match=string_pb2.StringMatcher(
            prefix=f"{EXT_AUTHZ_MATCH_PREFIX}-{provider}")))


def _timeout(provider: ExtAuthzProvider) -> duration_pb2.Duration:
    seconds = _DEFAULT_TIMEOUT if provider.timeout is None else provider.timeout
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


def _headers(patterns: Sequence[str]) -> string_pb2.ListStringMatcher | None:
    if not patterns:
        return None
    return string_pb2.ListStringMatcher(patterns=[
        string_pb2.StringMatcher(suffix=p[1:], ignore_case=True) if p.startswith("*")
        else string_pb2.StringMatcher(prefix=p[:-1], ignore_case=True) if p.endswith("*")
        else string_pb2.StringMatcher(exact=p, ignore_case=True) for p in patterns])


def _grpc_service(resolved: ResolvedProvider) -> grpc_service_pb2.GrpcService:
    assert resolved.provider is not None
    return grpc_service_pb2.GrpcService(
        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=resolved.cluster, authority=resolved.hostname),
        timeout=_timeout(resolved.provider))


def http_ext_authz(resolved: ResolvedProvider, rbac_filter: str) -> http_ext_authz_pb2.ExtAuthz:
    """The HTTP filter's config, as istiod's generateHTTPConfig / generateGRPCConfig."""
    p = resolved.provider
    assert p is not None
    config = http_ext_authz_pb2.ExtAuthz(
        failure_mode_allow=p.fail_open, transport_api_version=config_source_pb2.V3,
        filter_enabled_metadata=filter_enabled(rbac_filter, p.name), clear_route_cache=p.clear_route_cache)
    if p.request_body is not None:
        config.with_request_body.CopyFrom(http_ext_authz_pb2.BufferSettings(
            max_request_bytes=p.request_body.max_request_bytes,
            allow_partial_message=p.request_body.allow_partial_message, pack_as_bytes=p.request_body.pack_as_bytes))
    if p.status_on_error is not None:
        config.status_on_error.CopyFrom(http_status_pb2.HttpStatus(code=p.status_on_error))  # type: ignore[arg-type]
    if p.grpc:
        config.grpc_service.CopyFrom(_grpc_service(resolved))
        return config
    service = http_ext_authz_pb2.HttpService(
        path_prefix=p.path_prefix,
        server_uri=http_uri_pb2.HttpUri(uri=f"http://{resolved.hostname}", cluster=resolved.cluster,
                                        timeout=_timeout(p)))
    if p.include_additional_headers_in_check:
        service.authorization_request.headers_to_add.extend(
            base_pb2.HeaderValue(key=k, value=v) for k, v in p.include_additional_headers_in_check)
    if p.headers_to_upstream_on_allow or p.headers_to_downstream_on_deny or p.headers_to_downstream_on_allow:
        response = service.authorization_response
        for field, patterns in (("allowed_upstream_headers", p.headers_to_upstream_on_allow),
                                ("allowed_client_headers", p.headers_to_downstream_on_deny),
                                ("allowed_client_headers_on_success", p.headers_to_downstream_on_allow)):
            if (matcher := _headers(patterns)) is not None:
                getattr(response, field).CopyFrom(matcher)
    config.http_service.CopyFrom(service)
    if (allowed := _headers(p.include_request_headers_in_check)) is not None:
        config.allowed_headers.CopyFrom(allowed)
    return config


def network_ext_authz(resolved: ResolvedProvider, rbac_filter: str) -> network_ext_authz_pb2.ExtAuthz | None:
    """The TCP filter's config: only a gRPC provider has one (istiod ignores HTTP ones on TCP)."""
    p = resolved.provider
    assert p is not None
    if not p.grpc:
        return None
    return network_ext_authz_pb2.ExtAuthz(
        stat_prefix="tcp.", failure_mode_allow=p.fail_open, transport_api_version=config_source_pb2.V3,
        grpc_service=_grpc_service(resolved), filter_enabled_metadata=filter_enabled(rbac_filter, p.name))

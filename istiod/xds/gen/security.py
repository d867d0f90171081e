"""Which security policy applies to a workload's inbound port, for every flavor: the mTLS mode
PeerAuthentication gives it, and the AuthorizationPolicies and RequestAuthentications that select it. Pure."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2

from istiod.model.config import scope
from istiod.model.config.gateway_conversion import GATEWAY_NAME_LABEL
from istiod.model.config.security import AuthorizationPolicy, MTLSMode, RequestAuthentication
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.model.trustdomain import with_trust_domains
from istiod.xds.gen.authn import jwks_source, jwt_filter
from istiod.xds.gen.extauthz import ResolvedProvider, resolve_providers
from istiod.xds.gen.rbac import authorization_filters, custom_providers

log = logging.getLogger(__name__)


def inbound_mtls_mode(snapshot: Snapshot, proxy: Proxy, port: int) -> MTLSMode:
    """Workload, namespace, then mesh-wide PeerAuthentication (port-level first); with none, STRICT
    when the mesh turns mTLS on (`--mtls`) and istiod's PERMISSIVE otherwise."""
    default = MTLSMode.STRICT if snapshot.mesh.mtls else MTLSMode.PERMISSIVE
    return scope.peer_authentication_mode(snapshot.config.peer_authentications, proxy.namespace, workload_labels(snapshot, proxy),
                                          snapshot.mesh.root_namespace, port, default)


def authorization_policies(snapshot: Snapshot, proxy: Proxy) -> tuple[AuthorizationPolicy, ...]:
    """The policies selecting the proxy's workload, their identities renamed into the mesh's trust
    domain and its aliases."""
    domains = (snapshot.mesh.trust_domain, *snapshot.mesh.trust_domain_aliases)
    labels = workload_labels(snapshot, proxy)
    return tuple(with_trust_domains(p, domains) for p in scope.policies_for(
        snapshot.config.authorization_policies, proxy.namespace, labels, snapshot.mesh.root_namespace,
        _deployed_gateway(proxy, labels)))


def request_authentications(snapshot: Snapshot, proxy: Proxy) -> tuple[RequestAuthentication, ...]:
    labels = workload_labels(snapshot, proxy)
    return tuple(scope.policies_for(snapshot.config.request_authentications, proxy.namespace, labels,
                                    snapshot.mesh.root_namespace, _deployed_gateway(proxy, labels)))


def _deployed_gateway(proxy: Proxy, labels: Mapping[str, str]) -> str:
    """A gateway's Gateway (API) name, by its pods' label: what policies' targetRefs name it by."""
    return labels.get(GATEWAY_NAME_LABEL, "") if proxy.type == "router" else ""


def workload_labels(snapshot: Snapshot, proxy: Proxy) -> dict[str, str]:
    """The proxy's Pod labels from the registry, as istiod prefers them; else its LABELS metadata
    (proxyless bootstraps written outside Kubernetes rarely carry them)."""
    workload = snapshot.workloads.get((proxy.namespace, proxy.pod_name))
    return workload.label_map() if workload is not None else dict(proxy.labels)


@dataclass(frozen=True, slots=True)
class WorkloadPolicy:
    """The AuthorizationPolicies and RequestAuthentications selecting a workload (or gateway), with
    the extension providers its CUSTOM policies name and the keys istiod fetched for its jwksUris."""

    authorization: tuple[AuthorizationPolicy, ...]
    request_auth: tuple[RequestAuthentication, ...]
    providers: Mapping[str, ResolvedProvider]
    fetched_jwks: Mapping[str, str]

    @property
    def scope(self) -> str:
        """What tells this policy apart in a cache scope (fetched keys change without the objects)."""
        return ",".join(str(p.meta) for p in self.authorization) + ":" + ",".join(
            str(r.meta) for r in self.request_auth) + ":" + ",".join(
            f"{name}={resolved}" for name, resolved in self.providers.items()) + ":" + ",".join(
            f"{uri}#{hash(keys)}" for uri, keys in sorted(self.fetched_jwks.items()))

    def http_filters(self, where: str, clear_route_cache: bool = False,
                     peer_state: bool = False) -> tuple[hcm_pb2.HttpFilter, ...]:
        """jwt_authn, then the authorization filters (CUSTOM, AUDIT, DENY, ALLOW), for Envoy's HTTP
        chains; what is not translated as written is warned about, naming `where`. `clear_route_cache`:
        see jwt_filter (gateways); `peer_state`: see authorization_filters (waypoints)."""
        authz = authorization_filters(self.authorization, request_auth=True, providers=self.providers,
                                      peer_state=peer_state)
        for problem in authz.problems:
            log.warning("%s (%s)", problem, where)
        jwt = jwt_filter(self.request_auth, self.fetched_jwks, clear_route_cache)
        return (jwt, *authz.filters) if jwt is not None else authz.filters


def workload_policy(snapshot: Snapshot, proxy: Proxy) -> WorkloadPolicy:
    policies = authorization_policies(snapshot, proxy)
    request_auth = request_authentications(snapshot, proxy)
    return WorkloadPolicy(policies, request_auth, resolve_providers(snapshot, custom_providers(policies)),
                          fetched_keys(snapshot, request_auth))


def fetched_keys(snapshot: Snapshot, request_auth: tuple[RequestAuthentication, ...]) -> dict[str, str]:
    """The keys istiod fetched for these policies' jwksUris (and issuers' discovery documents)."""
    return {jwks_source(r): snapshot.jwks[jwks_source(r)]
            for p in request_auth for r in p.jwt_rules if not r.jwks and jwks_source(r) in snapshot.jwks}

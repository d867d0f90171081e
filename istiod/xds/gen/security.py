"""Which security policy applies to a workload's inbound port, for every flavor: the mTLS mode
PeerAuthentication gives it, and the AuthorizationPolicies and RequestAuthentications that select it. Pure."""

from __future__ import annotations

from istiod.model.config import scope
from istiod.model.config.security import AuthorizationPolicy, MTLSMode, RequestAuthentication
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot


def inbound_mtls_mode(snapshot: Snapshot, proxy: Proxy, port: int) -> MTLSMode:
    """Workload, namespace, then mesh-wide PeerAuthentication (port-level first); with none, STRICT
    when the mesh turns mTLS on (`--mtls`) and istiod's PERMISSIVE otherwise."""
    default = MTLSMode.STRICT if snapshot.mesh.mtls else MTLSMode.PERMISSIVE
    return scope.peer_authentication_mode(snapshot.config.peer_authentications, proxy.namespace, workload_labels(snapshot, proxy),
                                          snapshot.mesh.root_namespace, port, default)


def authorization_policies(snapshot: Snapshot, proxy: Proxy) -> tuple[AuthorizationPolicy, ...]:
    return tuple(scope.policies_for(snapshot.config.authorization_policies, proxy.namespace, workload_labels(snapshot, proxy),
                                    snapshot.mesh.root_namespace))


def request_authentications(snapshot: Snapshot, proxy: Proxy) -> tuple[RequestAuthentication, ...]:
    return tuple(scope.policies_for(snapshot.config.request_authentications, proxy.namespace,
                                    workload_labels(snapshot, proxy), snapshot.mesh.root_namespace))


def workload_labels(snapshot: Snapshot, proxy: Proxy) -> dict[str, str]:
    """The proxy's Pod labels from the registry, as istiod prefers them; else its LABELS metadata
    (proxyless bootstraps written outside Kubernetes rarely carry them)."""
    workload = snapshot.workloads.get((proxy.namespace, proxy.pod_name))
    return workload.label_map() if workload is not None else dict(proxy.labels)

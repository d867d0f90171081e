"""Certificates on behalf of a node's workloads (Istio's NodeAuthorizer): ztunnel asks for each
workload on its node, naming it in the request's metadata (`ImpersonatedIdentity`).

Allowed only when the caller's token is a trusted node account's (CA_TRUSTED_NODE_ACCOUNTS), bound
to a pod istiod knows with that account, and a pod of the impersonated service account runs on that
pod's node. The pods and nodes are the model's (the snapshot), so no API call is made per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from istiod.ca.authenticate import Caller
from istiod.ca.settings import NODE_ACCOUNTS_VARIABLE
from istiod.model.names import parse_spiffe_identity
from istiod.model.snapshot import Snapshot
from istiod.model.workload import Workload

IMPERSONATED_IDENTITY = "ImpersonatedIdentity"  # Istio's security.ImpersonatedIdentity metadata key
MAX_QUOTED = 120  # an impersonated identity is quoted in refusals and logs up to this many characters


class ImpersonationDenied(Exception):
    """Why a caller may not have a certificate for the identity it named."""


@dataclass(frozen=True, slots=True)
class _NodeIndex:
    """Which (node, namespace, service account) have a pod that can still run, for one set of pods
    (a snapshot keeps its predecessor's mapping while no pod changed, so this is rebuilt only then)."""

    workloads: Mapping[tuple[str, str], Workload]
    accounts: frozenset[tuple[str, str, str]]

    @classmethod
    def of(cls, workloads: Mapping[tuple[str, str], Workload]) -> _NodeIndex:
        return cls(workloads, frozenset((w.node_name, w.namespace, w.service_account)
                                        for w in workloads.values() if w.node_name and not w.terminal))


class NodeAuthorizer:
    def __init__(self, trusted: Iterable[tuple[str, str]], snapshot: Callable[[], Snapshot]) -> None:
        self.trusted = frozenset(trusted)
        self.snapshot = snapshot
        self._index: _NodeIndex | None = None

    def authorize(self, caller: Caller, requested: str) -> str:
        """The identity to sign for `caller`, who asks for `requested`; ImpersonationDenied says why not."""
        snapshot = self.snapshot()
        if not self.trusted:
            raise ImpersonationDenied(f"no caller may impersonate ({NODE_ACCOUNTS_VARIABLE} is empty)")
        account = caller.account
        if account is None or account not in self.trusted:
            who = "/".join(account) if account else ",".join(caller.identities)
            raise ImpersonationDenied(f"caller {who} is not a trusted node account ({NODE_ACCOUNTS_VARIABLE}: "
                                      f"{','.join(sorted('/'.join(a) for a in self.trusted))})")
        parsed = parse_spiffe_identity(requested)
        if parsed is None:
            raise ImpersonationDenied(f"impersonated identity {_quoted(requested)} is not "
                                      "spiffe://<trust domain>/ns/<namespace>/sa/<service account>")
        trust_domain, namespace, service_account = parsed
        if trust_domain != snapshot.mesh.trust_domain:
            raise ImpersonationDenied(f"impersonated identity {_quoted(requested)} is not in the mesh's trust domain "
                                      f"{snapshot.mesh.trust_domain!r}")
        node = self._caller_node(caller, account, snapshot)
        if (node, namespace, service_account) not in self._node_index(snapshot.workloads).accounts:
            raise ImpersonationDenied(f"no pod of service account {namespace}/{service_account} runs on node {node!r}")
        return requested

    @staticmethod
    def _caller_node(caller: Caller, account: tuple[str, str], snapshot: Snapshot) -> str:
        """The node the caller's pod runs on, as istiod knows it (the token's claims checked against it)."""
        bound = caller.pod
        if bound is None:
            raise ImpersonationDenied("the caller's token is not bound to a pod, so its node is unknown")
        namespace, service_account = account
        pod = snapshot.workloads.get((namespace, bound.name))
        if pod is None:
            raise ImpersonationDenied(f"the caller's pod {namespace}/{bound.name} is unknown")
        if bound.uid and pod.uid != bound.uid:
            # A pod recreated under the same name: the caller retries once istiod sees the new one.
            raise ImpersonationDenied(f"the caller's pod {namespace}/{bound.name} has UID {pod.uid!r}, "
                                      f"not the token's {bound.uid!r}")
        if pod.service_account != service_account:
            raise ImpersonationDenied(f"the caller's pod {namespace}/{bound.name} runs as service account "
                                      f"{pod.service_account!r}, not {service_account!r}")
        if not pod.node_name:
            raise ImpersonationDenied(f"the caller's pod {namespace}/{bound.name} is not on a node")
        if bound.node and bound.node != pod.node_name:
            raise ImpersonationDenied(f"the token names node {bound.node!r}, but the caller's pod "
                                      f"{namespace}/{bound.name} is on {pod.node_name!r}")
        if pod.node_name not in snapshot.nodes:
            raise ImpersonationDenied(f"the caller's node {pod.node_name!r} is unknown")
        return pod.node_name

    def _node_index(self, workloads: Mapping[tuple[str, str], Workload]) -> _NodeIndex:
        if self._index is None or self._index.workloads is not workloads:
            self._index = _NodeIndex.of(workloads)
        return self._index


def _quoted(text: str) -> str:
    return repr(text if len(text) <= MAX_QUOTED else text[:MAX_QUOTED] + "...")

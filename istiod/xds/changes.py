"""What a new snapshot changed since the previous one, as far as the ADS push needs to know: which
endpoints and pods, and which kinds of Istio config (and gateways' credentials); or more (Services,
the mesh config: then every connection regenerates everything).

Snapshots reuse unchanged values (istiod/model/builder.py), so most comparisons stop at identity.
"""

from __future__ import annotations

from dataclasses import dataclass

from istiod.model.service import Endpoint
from istiod.model.snapshot import Snapshot

Key = tuple[str, int]  # (service hostname, service port): one entry of Snapshot.endpoints


@dataclass(frozen=True, slots=True)
class EndpointChanges:
    keys: frozenset[Key]  # whose endpoints changed: their clusters' EDS
    identities: frozenset[Key]  # of those, whose service accounts or labels changed: clusters name them
    addresses: frozenset[str]  # of endpoints that came, went or changed: the pods there serve other ports
    workloads: frozenset[tuple[str, str]]  # (namespace, pod) whose Pod changed: its proxy's own policies


@dataclass(frozen=True, slots=True)
class Changes:
    endpoints: EndpointChanges
    kinds: frozenset[str]  # of Istio config that changed, and "Secret" if gateways' credentials did


def changes(previous: Snapshot | None, current: Snapshot) -> Changes | None:
    """None when Services, the mesh config or the set of service ports with endpoints changed, or
    when there is nothing to compare with."""
    # Identity first: snapshots carry unchanged values over.
    if previous is None or previous.mesh != current.mesh or _differ(previous.services, current.services):
        return None
    if previous.endpoints.keys() != current.endpoints.keys():
        return None
    kinds = current.config.kinds_changed_from(previous.config)
    if _differ(previous.credentials, current.credentials):
        kinds.add("Secret")
    return Changes(_endpoint_changes(previous, current), frozenset(kinds))


def _differ(old: object, new: object) -> bool:
    return old is not new and old != new


def _endpoint_changes(previous: Snapshot, current: Snapshot) -> EndpointChanges:
    keys: set[Key] = set()
    identities: set[Key] = set()
    addresses: set[str] = set()
    for key, endpoints in current.endpoints.items():
        old = previous.endpoints[key]
        if old is endpoints:
            continue
        keys.add(key)
        before, after = set(old), set(endpoints)
        addresses.update(e.address for e in before ^ after)
        if {_identity(e) for e in before} != {_identity(e) for e in after}:
            identities.add(key)
    workloads = {k for k, w in current.workloads.items() if (old_w := previous.workloads.get(k)) is not w and old_w != w}
    workloads.update(previous.workloads.keys() - current.workloads.keys())
    return EndpointChanges(frozenset(keys), frozenset(identities), frozenset(addresses), frozenset(workloads))


def _identity(endpoint: Endpoint) -> tuple[object, ...]:
    """What a cluster takes from its endpoints: the identities (mTLS SANs) of those its subsets select."""
    return endpoint.namespace, endpoint.service_account, endpoint.labels

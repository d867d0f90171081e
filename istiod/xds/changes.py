"""What a new snapshot changed since the previous one, as far as the ADS push needs to know: which
endpoints and pods, which Services (by host, and the host spellings they claim), which kinds of
Istio config (and gateways' credentials); or more (the mesh config: then every connection
regenerates everything).

Snapshots reuse unchanged values (istiod/model/builder.py), so most comparisons stop at identity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from istiod.model.config.networking import HTTPRoute, L4Route
from istiod.model.config.scope import host_matches
from istiod.model.service import Endpoint
from istiod.model.snapshot import Snapshot
from istiod.xds.gen.network import service_gateways

Key = tuple[str, int]  # (service hostname, service port): one entry of Snapshot.endpoints


@dataclass(frozen=True, slots=True)
class EndpointChanges:
    keys: frozenset[Key]  # whose endpoints changed: their clusters' EDS
    # Of those, whose clusters name or carry their endpoints: with other service accounts or labels
    # (mTLS SANs, none when they came or went), or of a DNS-resolved host (the cluster holds them).
    identities: frozenset[Key]
    addresses: frozenset[str]  # of endpoints that came, went or changed: the pods there serve other ports
    workloads: frozenset[tuple[str, str]]  # (namespace, pod) whose Pod changed: its proxy's own policies


@dataclass(frozen=True, slots=True)
class Changes:
    endpoints: EndpointChanges
    kinds: frozenset[str]  # of Istio config that changed, and "Secret" if gateways' credentials did
    hosts: frozenset[str] = frozenset()  # whose Service came, went or changed
    # Every spelling those Services claim or claimed (a listener `host:port` may name them so).
    spellings: frozenset[str] = frozenset()
    # The hosts (patterns) of the DestinationRules that came, went or changed; None when a
    # VirtualService routes to one of them (other hosts' routes take its policy).
    rule_hosts: frozenset[str] | None = frozenset()


def changes(previous: Snapshot | None, current: Snapshot) -> Changes | None:
    """None when the mesh config, a Namespace's labels, a Node's locality or a network gateway
    Service changed, when a changed Service is a VirtualService's destination (routes of other
    hosts name it), or when there is nothing to compare with."""
    if previous is None or previous.mesh != current.mesh:
        return None
    # Namespace labels (ambient mode, waypoints) and Node localities are read by ztunnel's workloads
    # whole; both change rarely, and either rebuilds the whole snapshot anyway.
    if _differ(previous.namespaces, current.namespaces) or _differ(previous.nodes, current.nodes):
        return None
    hosts: set[str] = set()
    spellings: set[str] = set()
    # Identity first: snapshots carry unchanged values over.
    if _differ(previous.services, current.services):
        for host in previous.services.keys() | current.services.keys():
            old, new = previous.services.get(host), current.services.get(host)
            if _differ(old, new):
                if any(s is not None and service_gateways(s) for s in (old, new)):
                    return None  # a network gateway moved: every network's EDS, as istiod's full push
                hosts.add(host)
                spellings.update(*(s.aliases for s in (old, new) if s is not None))
        if _routed_to(previous, hosts.__contains__) or _routed_to(current, hosts.__contains__):
            return None
    kinds = current.config.kinds_changed_from(previous.config)
    if _differ(previous.credentials, current.credentials):
        kinds.add("Secret")
    if _differ(previous.jwks, current.jwks):  # keys fetched for a jwksUri: what reads RequestAuthentications
        kinds.add("RequestAuthentication")
    return Changes(_endpoint_changes(previous, current), frozenset(kinds), frozenset(hosts), frozenset(spellings),
                   _rule_hosts(previous, current) if "DestinationRule" in kinds else frozenset())


def _differ(old: object, new: object) -> bool:
    return old is not new and old != new


def _rule_hosts(previous: Snapshot, current: Snapshot) -> frozenset[str] | None:
    old, new = previous.config.all_destination_rules, current.config.all_destination_rules
    kept = {id(r) for r in old} & {id(r) for r in new}  # unchanged rules keep their identity
    patterns = frozenset(r.host for r in (*old, *new) if id(r) not in kept)

    def ruled(host: str) -> bool:
        return any(host_matches(pattern, host) for pattern in patterns)

    return None if _routed_to(previous, ruled) or _routed_to(current, ruled) else patterns


def _routed_to(snapshot: Snapshot, host: Callable[[str], bool]) -> bool:
    """Whether a VirtualService routes to a `host` (the route configurations of its own hosts depend
    on the destinations' Services and DestinationRules)."""
    for vs in snapshot.config.all_virtual_services:
        routes: list[HTTPRoute | L4Route] = [*vs.http, *vs.tcp, *vs.tls]
        if any(host(d.destination.host) for r in routes for d in r.route) or any(
                host(m.destination.host) for r in vs.http for m in r.mirrors):
            return True
    return False


def _endpoint_changes(previous: Snapshot, current: Snapshot) -> EndpointChanges:
    keys: set[Key] = set()
    identities: set[Key] = set()
    addresses: set[str] = set()
    gone = previous.endpoints.keys() - current.endpoints.keys()
    for key in [*current.endpoints, *gone]:
        old, endpoints = previous.endpoints.get(key), current.endpoints.get(key)
        if old is endpoints:
            continue
        keys.add(key)
        before, after = set(old or ()), set(endpoints or ())
        addresses.update(e.address for e in before ^ after)
        service = current.services.get(key[0]) or previous.services.get(key[0])
        if (service is not None and service.dns_resolved) or {_identity(e) for e in before} != {_identity(e) for e in after}:
            identities.add(key)
    workloads = {k for k, w in current.workloads.items() if _differ(previous.workloads.get(k), w)}
    workloads.update(previous.workloads.keys() - current.workloads.keys())
    return EndpointChanges(frozenset(keys), frozenset(identities), frozenset(addresses), frozenset(workloads))


def _identity(endpoint: Endpoint) -> tuple[object, ...]:
    """What a cluster takes from its endpoints: the identities (mTLS SANs) of those its subsets select."""
    return endpoint.namespace, endpoint.service_account, endpoint.labels

"""ztunnel's workload discovery (WDS): Address (workloads and services) and Authorization.

Every ztunnel sees the same resources: they are made once per snapshot for all of them, each from
the cache while what it reads is the same object (one pod changed: one workload made anew), and the
delta server sends each ztunnel only those that differ from what it holds.

A wildcard watch gets everything. With XDS_ON_DEMAND ztunnel names what it wants: `network/IP`
(the workloads and services at that address) or `namespace/hostname` (a service); a name that
names nothing is answered as removed, as Istio does (the server's delta step; a malformed one is
logged too).
"""

from __future__ import annotations

import ipaddress
import logging
import weakref
from collections.abc import Callable, Iterable, Mapping
from functools import partial

from google.protobuf.message import Message

from istiod import logs
from istiod.model.config.security import Action
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.model.workload import Workload
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.ztunnel import addresses as wds
from istiod.xds.gen.ztunnel import policies

log = logging.getLogger(__name__)
_bad_names = logs.Throttled(log)


class AddressTable:
    """Every Address resource of a snapshot, by name, and their names by `network/IP`; and what it
    was made of, so the next snapshot's is this one patched when only pods changed."""

    def __init__(self, cache: ResourceCache, inputs: tuple[object, ...], pods: Mapping[tuple[str, str], Workload],
                 resources: dict[str, Resource] | None = None,
                 by_address: dict[str, tuple[str, ...]] | None = None) -> None:
        self.cache = cache
        self.inputs = inputs
        self.pods = pods
        self.resources: dict[str, Resource] = resources or {}
        self.by_address: dict[str, tuple[str, ...]] = by_address or {}  # tuples: copies share them

    def put(self, name: str, depends_on: object, build: Callable[[], Message], addresses: Iterable[str],
            network: str = "") -> None:
        """Made anew only when an input is another object than last time: snapshots carry unchanged
        values (and maps with nothing changed in them) over."""
        if name in self.resources:
            return  # a ServiceEntry host that a Kubernetes Service (or an earlier entry) has
        self.resources[name] = self.cache.get(types.ADDRESS, name, depends_on, build)
        for address in addresses:
            key = f"{network}/{address}"
            self.by_address[key] = (*self.by_address.get(key, ()), name)

    def drop(self, name: str, addresses: Iterable[str]) -> None:
        if self.resources.pop(name, None) is None:
            return
        for address in addresses:
            key = f"/{address}"
            left = tuple(n for n in self.by_address.get(key, ()) if n != name)
            if left:
                self.by_address[key] = left
            else:
                self.by_address.pop(key, None)

    def put_pod(self, snapshot: Snapshot, pod: Workload, common: tuple[object, ...]) -> None:
        if wds.is_workload(pod):
            self.put(wds.pod_uid(pod.namespace, pod.name), (pod, *_local(snapshot, pod.namespace), *common),
                     partial(wds.pod_workload, snapshot, pod), [pod.ip])

    def next(self, snapshot: Snapshot, common: tuple[object, ...]) -> AddressTable:
        """This table with the pods that changed since made anew (the rest is the same objects)."""
        old, new = self.pods, snapshot.workloads
        table = AddressTable(self.cache, self.inputs, new, dict(self.resources), dict(self.by_address))
        if old is new:
            return table
        changed = [key for key, pod in new.items() if old.get(key) is not pod]
        for key in [*changed, *(key for key in old if key not in new)]:
            gone = old.get(key)
            if gone is not None:
                table.drop(wds.pod_uid(*key), [gone.ip])
            pod = new.get(key)
            if pod is not None:
                table.put_pod(snapshot, pod, common)
        return table


# The last table made with each cache, to patch into the next (a cache serves one server).
_previous: weakref.WeakKeyDictionary[ResourceCache, AddressTable] = weakref.WeakKeyDictionary()


def _local(snapshot: Snapshot, namespace: str) -> tuple[object, ...]:
    """What a pod or Service reads of its namespace: the Namespace (its waypoint's name) and its
    Services (they select pods; the same tuple while they are the same), so a Service
    changed elsewhere rebuilds none."""
    assert snapshot.selection is not None
    return snapshot.namespaces.get(namespace), snapshot.selection.namespaces.get(namespace)


def address_table(snapshot: Snapshot, cache: ResourceCache) -> AddressTable:
    config = snapshot.config
    # What pods and Services may read besides their own object and namespace; entries read the rest.
    common = (snapshot.nodes, snapshot.mesh, config.service_entries, config.authorization_policies,
              config.peer_authentications, config.gateway_api.waypoints)
    shared = (snapshot.services, snapshot.namespaces, *common)
    inputs = (*shared, config.workload_entries)
    previous = _previous.get(cache)
    if previous is not None and all(a is b for a, b in zip(previous.inputs, inputs)):
        table = _previous[cache] = previous.next(snapshot, common)
        return table
    table = AddressTable(cache, inputs, snapshot.workloads)
    for service in snapshot.services.values():
        if not service.external_host:
            table.put(wds.service_name(service.namespace, service.hostname),
                      (service, *_local(snapshot, service.namespace), snapshot.mesh, config.gateway_api.waypoints),
                      partial(wds.kube_service, snapshot, service), _ips([service.cluster_ip]))
    taken = {s.hostname for s in snapshot.services.values() if not s.external_host}
    for entry in config.service_entries:
        canonical = wds.canonical_hosts(entry, taken)
        for name, address in wds.entry_services(snapshot, entry, canonical):
            table.put(name, (entry, *shared), partial(_same, address), _ips(entry.addresses))
        for member, services in wds.entry_endpoints(entry):
            uid = wds.entry_endpoint_uid(entry.meta.namespace, entry.meta.name, member.address)
            # The entry's name and labels (none are kept: policies with a selector pick none) for
            # its policies and canonical name, as istiod.
            table.put(uid, (entry, *shared), partial(wds.entry_workload, snapshot, member, uid, services,
                                                    entry.meta.name, {}),
                      _ips([member.address]), member.network)
    for member in config.workload_entries:
        uid = wds.workload_entry_uid(member.meta.namespace, member.meta.name)
        table.put(uid, (member, *shared), partial(wds.workload_entry, snapshot, member, uid),
                  _ips([member.address]), member.network)
    for pod in snapshot.workloads.values():
        table.put_pod(snapshot, pod, common)
    _previous[cache] = table
    return table


def _same(message: Message) -> Message:
    return message


def _ips(values: Iterable[str]) -> list[str]:
    result = []
    for value in values:
        try:
            result.append(str(ipaddress.ip_address(value)))
        except ValueError:
            continue  # a CIDR, a hostname, none
    return result


def addresses(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    table = cache.per_snapshot(snapshot, address_table, partial(address_table, snapshot, cache))
    if names is None:
        return list(table.resources.values())
    found: dict[str, Resource] = {}
    for name in names:
        named = [name] if name in table.resources else table.by_address.get(name, [])
        if not named and not _well_formed(name):
            _bad_names.warning(logs.event("wds: on-demand name is neither network/IP nor namespace/hostname",
                                          proxy=proxy.id, resource=name[:256]))
        found.update((n, table.resources[n]) for n in named)
    return list(found.values())


def _well_formed(name: str) -> bool:
    head, slash, tail = name.partition("/")
    if not slash or not tail:
        return False
    try:
        ipaddress.ip_address(tail)
        return True
    except ValueError:
        return bool(head) and "/" not in tail


def authorizations(snapshot: Snapshot, proxy: Proxy, names: list[str] | None,
                   cache: ResourceCache) -> list[Resource]:
    made = cache.per_snapshot(snapshot, authorizations, partial(_authorization_table, snapshot, cache))
    return list(made.values()) if names is None else [made[n] for n in dict.fromkeys(names) if n in made]


def _authorization_table(snapshot: Snapshot, cache: ResourceCache) -> dict[str, Resource]:
    root = snapshot.mesh.root_namespace
    config = snapshot.config
    made: dict[str, Resource] = {}

    def put(namespace: str, name: str, depends_on: object, build: Callable[[], Message | None]) -> None:
        key = f"{namespace}/{name}"
        made[key] = cache.get(types.AUTHORIZATION, key, depends_on, build)  # type: ignore[arg-type]

    for policy in config.authorization_policies:
        if policy.action in (Action.ALLOW, Action.DENY) and not policy.target_refs:  # targetRefs: waypoints'
            put(policy.meta.namespace, policy.meta.name, (policy, root), partial(policies.authorization, policy, root))
    if config.peer_authentications:
        put(root, policies.STATIC_STRICT_NAME, root, partial(policies.static_strict, root))
    for peer in config.peer_authentications:
        own, mesh = policies.levels(config.peer_authentications, peer.meta.namespace, root)
        if policies.converted(peer, own, mesh, root) is not None:
            put(peer.meta.namespace, policies.CONVERTED_PREFIX + peer.meta.name, (peer, own, mesh, root),
                partial(policies.converted, peer, own, mesh, root))
    return made


GENERATORS: dict[str, Callable[[Snapshot, Proxy, list[str] | None, ResourceCache], list[Resource]]] = {
    types.ADDRESS: addresses, types.AUTHORIZATION: authorizations}

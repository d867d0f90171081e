"""Who watches what: from a service port to the connections holding its clusters and endpoints, and
from a pod (its addresses, its name) to its proxy's connections, so that an endpoint change wakes
only the connections it concerns, for only the types it can change; and a change of Istio config
only the types of each connection that read that kind; a change of Services, of a proxyless
client only the types whose names it watches refer to them (Envoy's wildcards see every Service).

Only clusters and endpoints follow a service port's endpoints (clusters for the identities they
name); listeners and routes do not, except a pod's own inbound side, which the pod index covers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from istiod.model.config.scope import host_matches
from istiod.model.names import parse_cluster_name, split_host_port
from istiod.xds import types
from istiod.xds.changes import Changes, Key
from istiod.xds.connection import Connection, PushScope
from istiod.xds.gen import affected_types

INDEXED_TYPES = (types.CLUSTER, types.ENDPOINT)
_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V", bound=Hashable)


@dataclass(eq=False, slots=True)
class _Group:
    """The connections watching the same names of one type, and those names by service port: made
    once however many watch them (500 Envoys each watching the same 1000 clusters cost one index,
    not 500)."""

    names: frozenset[str]
    by_key: dict[Key, frozenset[str]]
    connections: set[Connection] = field(default_factory=set)


class Watchers:
    def __init__(self) -> None:
        # type -> service port -> the groups watching some of its clusters
        self._by_key: dict[str, dict[Key, set[_Group]]] = {t: {} for t in INDEXED_TYPES}
        self._groups: dict[str, dict[frozenset[str], _Group]] = {t: {} for t in INDEXED_TYPES}
        self._wildcard: dict[str, set[Connection]] = {t: set() for t in INDEXED_TYPES}
        # What each is indexed under: its group per type, None for a wildcard.
        self._watching: dict[Connection, dict[str, _Group | None]] = {}
        self._by_address: dict[str, set[Connection]] = {}
        self._by_pod: dict[tuple[str, str], set[Connection]] = {}
        self._ztunnels: set[Connection] = set()

    def add(self, connection: Connection) -> None:
        self._watching[connection] = {}
        for address in connection.proxy.ip_addresses:
            self._by_address.setdefault(address, set()).add(connection)
        self._by_pod.setdefault(_pod(connection), set()).add(connection)
        if connection.proxy.type == "ztunnel":
            self._ztunnels.add(connection)

    def remove(self, connection: Connection) -> None:
        for type_url in self._watching.get(connection, {}).copy():
            self.watch(connection, type_url, [])
        self._watching.pop(connection, None)
        for address in connection.proxy.ip_addresses:
            _discard(self._by_address, address, connection)
        _discard(self._by_pod, _pod(connection), connection)
        self._ztunnels.discard(connection)

    def watch(self, connection: Connection, type_url: str, names: Iterable[str] | None) -> None:
        """The connection now watches `names` (None: every resource) of the type."""
        if type_url not in self._by_key or connection not in self._watching:
            return
        watching = self._watching[connection]
        if type_url in watching:
            held = watching.pop(type_url)
            if held is None:
                self._wildcard[type_url].discard(connection)
            else:
                self._leave(type_url, held, connection)
        if names is None:
            self._wildcard[type_url].add(connection)
            watching[type_url] = None
        elif wanted := frozenset(names):
            group = self._groups[type_url].get(wanted) or self._group(type_url, wanted)
            group.connections.add(connection)
            watching[type_url] = group

    def watching(self, connection: Connection, type_url: str, names: Iterable[str]) -> set[str]:
        """Those of `names` (cluster names) that the connection watches of the type, found in the
        index: O(len(names)), where the connection's own list (an Envoy's names every cluster) is O(all)."""
        group = self._watching.get(connection, {}).get(type_url)
        if group is None:
            return set()
        return {name for name in names if name in group.names and _key(name) is not None}

    def _group(self, type_url: str, names: frozenset[str]) -> _Group:
        by_key: dict[Key, set[str]] = {}
        for name in names:
            if (key := _key(name)) is not None:
                by_key.setdefault(key, set()).add(name)
        group = self._groups[type_url][names] = _Group(names, {key: frozenset(n) for key, n in by_key.items()})
        index = self._by_key[type_url]
        for key in group.by_key:
            index.setdefault(key, set()).add(group)
        return group

    def _leave(self, type_url: str, group: _Group, connection: Connection) -> None:
        group.connections.discard(connection)
        if group.connections:
            return
        del self._groups[type_url][group.names]
        index = self._by_key[type_url]
        for key in group.by_key:
            _discard(index, key, group)

    def woken(self, change: Changes) -> dict[Connection, PushScope | None]:
        """The connections the changes concern and what each must regenerate (None: everything)."""
        endpoints = change.endpoints
        scopes: dict[Connection, PushScope] = {}
        for key in endpoints.keys:
            for group in self._by_key[types.ENDPOINT].get(key, ()):
                names = group.by_key[key]
                for connection in group.connections:
                    eds = scopes.setdefault(connection, {}).setdefault(types.ENDPOINT, set())
                    if eds is not None:
                        eds.update(names)
        for connection in self._wildcard[types.ENDPOINT] if endpoints.keys else ():
            scopes.setdefault(connection, {})[types.ENDPOINT] = None
        clusters = set(self._wildcard[types.CLUSTER]) if endpoints.identities else set()
        for key in endpoints.identities:
            for group in self._by_key[types.CLUSTER].get(key, ()):
                clusters.update(group.connections)
        for connection in clusters:
            scopes.setdefault(connection, {})[types.CLUSTER] = None
        if change.kinds:
            for connection in self._watching:
                if affected := _config_scope(connection, change):
                    scopes.setdefault(connection, {}).update(affected)
        everything = {c for address in endpoints.addresses for c in self._by_address.get(address, ())}
        if change.hosts:
            for connection in self._watching:
                referring = _referring(connection, change.hosts.__contains__, change.spellings)
                if referring is None:
                    everything.add(connection)
                elif referring:
                    scopes.setdefault(connection, {}).update(referring)
        everything.update(c for pod in endpoints.workloads for c in self._by_pod.get(pod, ()))
        if endpoints.keys or endpoints.workloads or change.hosts:
            # A ztunnel holds every workload and service: it compares them all (each made once per
            # snapshot for every ztunnel) and is sent only those that differ.
            for connection in self._ztunnels:
                scopes.setdefault(connection, {})[types.ADDRESS] = None
        return {**scopes, **dict.fromkeys(everything)}


def _key(name: str) -> Key | None:
    """The service port an `outbound|<port>|<subset>|<host>` cluster name refers to."""
    try:
        direction, port, _, host = parse_cluster_name(name)
    except ValueError:
        return None
    return (host, port) if direction == "outbound" else None


def _config_scope(connection: Connection, change: Changes) -> PushScope:
    """The types that read the changed kinds; of a proxyless client, for DestinationRules, only
    those whose watched names are of a host the rules name."""
    kinds, scope = change.kinds, {}
    rule_hosts = change.rule_hosts
    if "DestinationRule" in kinds and rule_hosts is not None and connection.proxy.proxyless:
        kinds = kinds - {"DestinationRule"}
        referring = _referring(connection, lambda host: any(host_matches(p, host) for p in rule_hosts))
        ruled = affected_types(connection.proxy, ["DestinationRule"])
        scope = dict.fromkeys(ruled if referring is None else ruled.intersection(referring))
    return {**scope, **dict.fromkeys(affected_types(connection.proxy, kinds))}


def _referring(connection: Connection, host: Callable[[str], bool],
               spellings: frozenset[str] = frozenset()) -> PushScope | None:
    """The types whose watched names refer to a `host` (listeners: by one of `spellings`); None
    (all) for a connection that is not proxyless or watches some type whole."""
    if not connection.proxy.proxyless:
        return None
    scope: PushScope = {}
    for type_url, watched in connection.watched.items():
        if watched.names is None:
            return None
        if any(_refers(type_url, name, connection.proxy.namespace, host, spellings) for name in watched.names):
            scope[type_url] = None
    return scope


def _refers(type_url: str, name: str, namespace: str, host: Callable[[str], bool], spellings: frozenset[str]) -> bool:
    """Listeners `host:port` by any spelling (a bare name, from the client's namespace); route
    configurations, clusters and their endpoints by `outbound|port|subset|host`. Inbound listeners
    follow their pod's endpoints (the address index)."""
    if type_url == types.LISTENER:
        try:
            spelled, _ = split_host_port(name)
        except ValueError:
            return False
        return spelled in spellings or f"{spelled}.{namespace}" in spellings
    key = _key(name)
    return key is not None and host(key[0])


def _pod(connection: Connection) -> tuple[str, str]:
    return connection.proxy.namespace, connection.proxy.pod_name


def _discard(index: dict[_K, set[_V]], key: _K, member: _V) -> None:
    members = index.get(key)
    if members is not None:
        members.discard(member)
        if not members:
            del index[key]

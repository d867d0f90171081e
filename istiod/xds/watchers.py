"""Who watches what: from a service port to the connections holding its clusters and endpoints, and
from a pod (its addresses, its name) to its proxy's connections, so that an endpoint change wakes
only the connections it concerns, for only the types it can change; and a change of Istio config
only the types of each connection that read that kind; a change of Services, of a proxyless
client only the types whose names it watches refer to them (Envoy's wildcards see every Service).

Only clusters and endpoints follow a service port's endpoints (clusters for the identities they
name); listeners and routes do not, except a pod's own inbound side, which the pod index covers.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from istiod.model.config.scope import host_matches
from istiod.model.names import parse_cluster_name, split_host_port
from istiod.xds import types
from istiod.xds.changes import Changes, Key
from istiod.xds.connection import Connection, PushScope
from istiod.xds.gen import affected_types

INDEXED_TYPES = (types.CLUSTER, types.ENDPOINT)
_K = TypeVar("_K", bound=Hashable)


class Watchers:
    def __init__(self) -> None:
        # type -> service port -> connection -> the names of that port's clusters it watches
        self._by_key: dict[str, dict[Key, dict[Connection, frozenset[str]]]] = {t: {} for t in INDEXED_TYPES}
        self._wildcard: dict[str, set[Connection]] = {t: set() for t in INDEXED_TYPES}
        # What each is indexed under: tuples, not sets (a small set costs 216 bytes or more, and a
        # proxyless connection has ten of them).
        self._watching: dict[Connection, dict[str, tuple[str, ...] | None]] = {}
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
        held = watching.get(type_url, ())
        new = None if names is None else tuple(dict.fromkeys(names))
        if held is None:
            self._wildcard[type_url].discard(connection)
        if new is None:
            self._wildcard[type_url].add(connection)
        old, wanted = set(held or ()), set(new or ())
        by_key = self._by_key[type_url]
        changes = [(name, key, False) for name in old - wanted if (key := _key(name)) is not None]
        changes += [(name, key, True) for name in wanted - old if (key := _key(name)) is not None]
        after: dict[Key, set[str]] = {}  # per service port changed, the names the connection watches of it
        for name, key, added in changes:
            of_key = after.get(key)
            if of_key is None:
                of_key = after[key] = set(by_key.get(key, {}).get(connection, ()))
            if added:
                of_key.add(name)
            else:
                of_key.discard(name)
        for key, of_key in after.items():
            if of_key:
                by_key.setdefault(key, {})[connection] = _shared(of_key)
            else:
                connections = by_key[key]
                del connections[connection]
                if not connections:
                    del by_key[key]
        watching[type_url] = new

    def watching(self, connection: Connection, type_url: str, names: Iterable[str]) -> set[str]:
        """Those of `names` (cluster names) that the connection watches of the type, found in the
        index: O(len(names)), where the connection's own list (an Envoy's names every cluster) is O(all)."""
        by_key = self._by_key[type_url]
        return {name for name in names
                if (key := _key(name)) is not None and name in by_key.get(key, {}).get(connection, ())}

    def woken(self, change: Changes) -> dict[Connection, PushScope | None]:
        """The connections the changes concern and what each must regenerate (None: everything)."""
        endpoints = change.endpoints
        scopes: dict[Connection, PushScope] = {}
        for key in endpoints.keys:
            for connection, names in self._by_key[types.ENDPOINT].get(key, {}).items():
                eds = scopes.setdefault(connection, {}).setdefault(types.ENDPOINT, set())
                if eds is not None:
                    eds.update(names)
        for connection in self._wildcard[types.ENDPOINT] if endpoints.keys else ():
            scopes.setdefault(connection, {})[types.ENDPOINT] = None
        clusters = set(self._wildcard[types.CLUSTER]) if endpoints.identities else set()
        for key in endpoints.identities:
            clusters.update(self._by_key[types.CLUSTER].get(key, {}))
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


def _shared(names: set[str]) -> frozenset[str]:
    """One set per distinct set of names, however many connections watch it (500 Envoys watching every
    cluster would otherwise hold a set per cluster each)."""
    key = frozenset(names)
    shared = _names.get(key)
    if shared is None:
        shared = _names[key] = frozenset(names)  # not the key, which the table holds strongly
    return shared


# An entry goes with the last connection watching its names.
_names: weakref.WeakValueDictionary[frozenset[str], frozenset[str]] = weakref.WeakValueDictionary()


# Remembered: 500 Envoys each watch, and at the end unwatch, the same 1000 names. Bounded, as a
# client may name anything.
@functools.lru_cache(maxsize=1 << 16)
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


def _discard(index: dict[_K, set[Connection]], key: _K, connection: Connection) -> None:
    members = index.get(key)
    if members is not None:
        members.discard(connection)
        if not members:
            del index[key]

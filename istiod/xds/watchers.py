"""Who watches what: from a service port to the connections holding its clusters and endpoints, and
from a pod (its addresses, its name) to its proxy's connections, so that an endpoint change wakes
only the connections it concerns, for only the types it can change.

Only clusters and endpoints follow a service port's endpoints (clusters for the identities they
name); listeners and routes do not, except a pod's own inbound side, which the pod index covers.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

from istiod.model.names import parse_cluster_name
from istiod.xds import types
from istiod.xds.changes import EndpointChanges, Key
from istiod.xds.connection import Connection, PushScope

INDEXED_TYPES = (types.CLUSTER, types.ENDPOINT)
_K = TypeVar("_K", bound=Hashable)


class Watchers:
    def __init__(self) -> None:
        # type -> service port -> connection -> the names of that port's clusters it watches. Tuples,
        # not sets, here and in _watching: one to five names each, 10 of them per proxyless
        # connection; a set of up to 4 costs 216 bytes, of 5 728, a tuple 48 + 8 per name.
        self._by_key: dict[str, dict[Key, dict[Connection, tuple[str, ...]]]] = {t: {} for t in INDEXED_TYPES}
        self._wildcard: dict[str, set[Connection]] = {t: set() for t in INDEXED_TYPES}
        self._watching: dict[Connection, dict[str, tuple[str, ...] | None]] = {}  # what each is indexed under
        self._by_address: dict[str, set[Connection]] = {}
        self._by_pod: dict[tuple[str, str], set[Connection]] = {}

    def add(self, connection: Connection) -> None:
        self._watching[connection] = {}
        for address in connection.proxy.ip_addresses:
            self._by_address.setdefault(address, set()).add(connection)
        self._by_pod.setdefault(_pod(connection), set()).add(connection)

    def remove(self, connection: Connection) -> None:
        for type_url in self._watching.get(connection, {}).copy():
            self.watch(connection, type_url, [])
        self._watching.pop(connection, None)
        for address in connection.proxy.ip_addresses:
            _discard(self._by_address, address, connection)
        _discard(self._by_pod, _pod(connection), connection)

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
        for name in old - wanted:
            key = _key(name)
            if key is not None:
                connections = by_key[key]
                if remaining := tuple(n for n in connections[connection] if n != name):
                    connections[connection] = remaining
                else:
                    del connections[connection]
                    if not connections:
                        del by_key[key]
        for name in wanted - old:
            key = _key(name)
            if key is not None:
                connections = by_key.setdefault(key, {})
                connections[connection] = (*connections.get(connection, ()), name)
        watching[type_url] = new

    def woken(self, changes: EndpointChanges) -> dict[Connection, PushScope | None]:
        """The connections the changes concern and what each must regenerate (None: everything)."""
        scopes: dict[Connection, PushScope] = {}
        for key in changes.keys:
            for connection, names in self._by_key[types.ENDPOINT].get(key, {}).items():
                eds = scopes.setdefault(connection, {}).setdefault(types.ENDPOINT, set())
                if eds is not None:
                    eds.update(names)
        for connection in self._wildcard[types.ENDPOINT] if changes.keys else ():
            scopes.setdefault(connection, {})[types.ENDPOINT] = None
        clusters = set(self._wildcard[types.CLUSTER]) if changes.identities else set()
        for key in changes.identities:
            clusters.update(self._by_key[types.CLUSTER].get(key, {}))
        for connection in clusters:
            scopes.setdefault(connection, {})[types.CLUSTER] = None
        everything = {c for address in changes.addresses for c in self._by_address.get(address, ())}
        everything.update(c for pod in changes.workloads for c in self._by_pod.get(pod, ()))
        return {**scopes, **dict.fromkeys(everything)}


def _key(name: str) -> Key | None:
    """The service port an `outbound|<port>|<subset>|<host>` cluster name refers to."""
    try:
        direction, port, _, host = parse_cluster_name(name)
    except ValueError:
        return None
    return (host, port) if direction == "outbound" else None


def _pod(connection: Connection) -> tuple[str, str]:
    return connection.proxy.namespace, connection.proxy.pod_name


def _discard(index: dict[_K, set[Connection]], key: _K, connection: Connection) -> None:
    members = index.get(key)
    if members is not None:
        members.discard(connection)
        if not members:
            del index[key]

"""Serialized resources, built once per input and shared by every connection that needs them.

An entry is valid while the model value it was built from is the same object: snapshots reuse
unchanged values, so identity is a cheap and exact dependency check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message


_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, eq=False)
class Resource:
    name: str
    type_url: str
    value: bytes  # the serialized message
    # Its element of a response's repeated `resources` field, serialized on first use and then shared by
    # every connection it is sent to (see istiod.xds.wire): memoized, so not part of the value.
    _sotw: bytes | None = field(default=None, init=False, repr=False)
    _delta: bytes | None = field(default=None, init=False, repr=False)

    def same_as(self, other: Resource | None) -> bool:
        return other is not None and (other is self or other.value == self.value)

    @property
    def version(self) -> str:
        """A version from the content, so a reconnecting delta client's `initial_resource_versions` tell
        what it holds whichever istiod sent it."""
        return hashlib.blake2b(self.value, digest_size=8).hexdigest()

    @property
    def sotw_entry(self) -> bytes:
        """The resource as one element of DiscoveryResponse.resources (an Any), tag and length included."""
        entry = self._sotw
        if entry is None:
            any_ = any_pb2.Any(type_url=self.type_url, value=self.value)
            entry = discovery_pb2.DiscoveryResponse(resources=[any_]).SerializeToString()
            object.__setattr__(self, "_sotw", entry)
        return entry

    @property
    def delta_entry(self) -> bytes:
        """The resource as one element of DeltaDiscoveryResponse.resources, tag and length included."""
        entry = self._delta
        if entry is None:
            resource = discovery_pb2.Resource(name=self.name, version=self.version,
                                              resource=any_pb2.Any(type_url=self.type_url, value=self.value))
            entry = discovery_pb2.DeltaDiscoveryResponse(resources=[resource]).SerializeToString()
            object.__setattr__(self, "_delta", entry)
        return entry


@dataclass(slots=True)
class _Entry:
    depends_on: object
    resource: Resource
    used: int


@dataclass(slots=True)
class _Derived:
    source: Resource  # held: the key has its id, which must not be reused while the entry lives
    resource: Resource | None
    used: int


class ResourceCache:
    def __init__(self) -> None:
        self._entries: dict[tuple[str, str, str], _Entry] = {}
        self._generation = 0
        self.hits = 0
        self._shared_of: object = None  # the snapshot `_shared` holds results of
        self._shared: dict[Hashable, Any] = {}
        self._derived: dict[tuple[int, Hashable], _Derived] = {}

    def get(self, type_url: str, name: str, depends_on: object, build: Callable[[], Message],
            scope: str = "") -> Resource:
        """`scope` tells apart resources of one name whose content differs between proxies (a
        sidecar's route `80` lists short host names only to proxies in the service's namespace)."""
        key = (type_url, name, scope)
        entry = self._entries.get(key)
        if entry is not None and _same(entry.depends_on, depends_on):
            entry.used = self._generation
            self.hits += 1
            return entry.resource
        resource = Resource(name, type_url, build().SerializeToString(deterministic=True))
        self._entries[key] = _Entry(depends_on, resource, self._generation)
        return resource

    def derived(self, source: Resource, how: Hashable, build: Callable[[], Message | None]) -> Resource | None:
        """What `build` makes of `source` (a changed copy of it; None: nothing), made once for as long
        as generators return that same resource and `how` (all else it depends on) is equal: across
        snapshots, as entries are."""
        key = (id(source), how)
        entry = self._derived.get(key)
        if entry is not None and entry.source is source:
            entry.used = self._generation
            return entry.resource
        message = build()
        resource = None if message is None else Resource(source.name, source.type_url,
                                                         message.SerializeToString(deterministic=True))
        self._derived[key] = _Derived(source, resource, self._generation)
        return resource

    def per_snapshot(self, snapshot: object, key: Hashable, build: Callable[[], _T]) -> _T:
        """What `build` makes of `snapshot`, made once per snapshot for every caller with the same `key`,
        which must name everything else the result depends on (the function, and the proxy's namespace
        and labels, say): 500 Envoys alike asking for every cluster share one list instead of making
        one each. Only the latest snapshot's results are kept."""
        if snapshot is not self._shared_of:
            self._shared_of, self._shared = snapshot, {}
        try:
            return self._shared[key]  # type: ignore[no-any-return]
        except KeyError:
            made = self._shared[key] = build()
            return made

    def sweep(self) -> None:
        """Drop entries no push used since the previous sweep; they rebuild if needed again."""
        self._entries = {k: e for k, e in self._entries.items() if e.used >= self._generation - 1}
        self._derived = {k: e for k, e in self._derived.items() if e.used >= self._generation - 1}
        self._generation += 1

    def __len__(self) -> int:
        return len(self._entries)


def _same(old: object, new: object) -> bool:
    """Identity; for a tuple of dependencies, identity of each member (the tuple itself is new per call)."""
    if old is new:
        return True
    return (
        type(old) is tuple and type(new) is tuple and len(old) == len(new)
        and all(a is b for a, b in zip(old, new))  # type: ignore[arg-type]
    )

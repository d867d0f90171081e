"""Serialized resources, built once per input and shared by every connection that needs them.

An entry is valid while the model value it was built from is the same object: snapshots reuse
unchanged values, so identity is a cheap and exact dependency check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message


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


class ResourceCache:
    def __init__(self) -> None:
        self._entries: dict[tuple[str, str, str], _Entry] = {}
        self._generation = 0
        self.hits = 0
        self._snapshot: object = None
        self._shared: dict[Hashable, dict[str, Resource | None]] = {}

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

    def shared(self, snapshot: object, key: Hashable) -> dict[str, Resource | None]:
        """What a generator made of each name for every proxy that `key` stands for (see
        gen.shared_by_name), under `snapshot` only: a new one starts them all afresh."""
        if snapshot is not self._snapshot:
            self._snapshot, self._shared = snapshot, {}
        table = self._shared.get(key)
        if table is None:
            table = self._shared[key] = {}
        return table

    def sweep(self) -> None:
        """Drop entries no push used since the previous sweep; they rebuild if needed again."""
        self._entries = {k: e for k, e in self._entries.items() if e.used >= self._generation - 1}
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

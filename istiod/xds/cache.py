"""Serialized resources, built once per input and shared by every connection that needs them.

An entry is valid while the model value it was built from is the same object: snapshots reuse
unchanged values, so identity is a cheap and exact dependency check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import Message


@dataclass(frozen=True, slots=True, eq=False)
class Resource:
    name: str
    type_url: str
    value: bytes  # the serialized message

    def same_as(self, other: Resource | None) -> bool:
        return other is not None and (other is self or other.value == self.value)


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

"""The object store: every Kubernetes object istiod knows, converted once, with change events.

Sources (config dir, informers) write here and nothing else; the snapshot builder reads from here.
A write that fails conversion raises and leaves the object's last good state in place.
"""

from __future__ import annotations

import enum
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from istiod.model.names import DEFAULT_DOMAIN
from istiod.sources.convert import ObjectKey, convert

log = logging.getLogger(__name__)


class EventType(enum.Enum):
    ADDED = "added"
    UPDATED = "updated"
    DELETED = "deleted"


@dataclass(frozen=True, slots=True)
class StoredObject:
    key: ObjectKey
    raw: Mapping[str, Any]
    value: Any  # the model value convert() made from raw


@dataclass(frozen=True, slots=True)
class Change:
    type: EventType
    key: ObjectKey


Listener = Callable[[Change], None]


class Store:
    def __init__(self, domain: str = DEFAULT_DOMAIN) -> None:
        self.domain = domain
        self._by_kind: dict[str, dict[ObjectKey, StoredObject]] = defaultdict(dict)
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def apply(self, raw: Mapping[str, Any]) -> Change | None:
        """Add or update one object; None when nothing changed. Raises ConversionError."""
        key, value = convert(raw, self.domain)
        objects = self._by_kind[key.kind]
        old = objects.get(key)
        if old is not None and old.value == value and _same_raw(old.raw, raw):
            return None
        objects[key] = StoredObject(key, raw, value)
        return self._emit(Change(EventType.UPDATED if old else EventType.ADDED, key))

    def delete(self, key: ObjectKey) -> Change | None:
        if self._by_kind[key.kind].pop(key, None) is None:
            return None
        return self._emit(Change(EventType.DELETED, key))

    def get(self, key: ObjectKey) -> StoredObject | None:
        return self._by_kind[key.kind].get(key)

    def values(self, kind: str) -> Iterator[Any]:
        return (o.value for o in self._by_kind[kind].values())

    def objects(self, kind: str | None = None) -> Iterator[StoredObject]:
        kinds = [kind] if kind else sorted(self._by_kind)
        for k in kinds:
            yield from self._by_kind[k].values()

    def keys(self, kind: str) -> set[ObjectKey]:
        return set(self._by_kind[kind])

    def _emit(self, change: Change) -> Change:
        for listener in self._listeners:
            try:
                listener(change)
            except Exception:  # one broken listener must not stop the others or the source
                log.exception("store listener failed on %s", change.key)
        return change


_VOLATILE_METADATA = frozenset({"resourceVersion", "managedFields", "generation"})


def _same_raw(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Objects are equal for us when their content is; a resourceVersion bump alone is no change."""
    return a is b or _content(a) == _content(b)


def _content(obj: Mapping[str, Any]) -> dict[str, Any]:
    metadata = obj.get("metadata") or {}
    return {**obj, "metadata": {k: v for k, v in metadata.items() if k not in _VOLATILE_METADATA}}

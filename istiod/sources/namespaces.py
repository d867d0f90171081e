"""Discovery selectors: which namespaces istiod reads (istiod's meshConfig.discoverySelectors).

A namespace is selected when any selector matches its labels; with no selectors, all are.
A selector is `key=value,key2` (every term must hold): `key=value` matches a label value,
a bare `key` that the label exists, `!key` that it does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Selector:
    equals: tuple[tuple[str, str], ...] = ()
    exists: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Selector:
        equals, exists, absent = [], [], []
        for term in (t.strip() for t in text.split(",")):
            if not term:
                raise ValueError(f"discovery selector {text!r} has an empty term")
            if "=" in term:
                key, _, value = term.partition("=")
                equals.append((key.strip(), value.strip()))
            elif term.startswith("!"):
                absent.append(term[1:])
            else:
                exists.append(term)
        return cls(tuple(equals), tuple(exists), tuple(absent))

    def matches(self, labels: dict[str, str]) -> bool:
        return (
            all(labels.get(k) == v for k, v in self.equals)
            and all(k in labels for k in self.exists)
            and not any(k in labels for k in self.absent)
        )


class LabelMatcher(Protocol):
    """A flag's Selector, or the mesh config's LabelSelector (matchLabels and matchExpressions)."""

    def matches(self, labels: dict[str, str]) -> bool: ...


@dataclass
class NamespaceFilter:
    selectors: tuple[LabelMatcher, ...] = ()
    _selected: dict[str, bool] = field(default_factory=dict)

    def selected(self, namespace: str) -> bool:
        return not self.selectors or self._selected.get(namespace, False)

    def update(self, namespace: str, labels: dict[str, str]) -> bool:
        """Record a namespace's labels; True when that changed whether it is selected."""
        now = any(s.matches(labels) for s in self.selectors)
        before = self._selected.get(namespace, False)  # objects seen before their namespace wait
        self._selected[namespace] = now
        return bool(self.selectors) and before != now

    def forget(self, namespace: str) -> None:
        self._selected.pop(namespace, None)

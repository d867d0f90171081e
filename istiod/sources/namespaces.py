"""Discovery selectors: which namespaces istiod reads (istiod's meshConfig.discoverySelectors).

A namespace is selected when any selector matches its labels; with no selectors, all are.
A selector is a Kubernetes label selector, as `kubectl -l` takes it: comma-separated
requirements that must all hold, each `key`, `!key`, `key=value` (or `==`), `key!=value`,
`key in (a,b)`, `key notin (a,b)`, `key>N` or `key<N`. Anything else is an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from istiod.model.labels import Requirement, Selector

# Label keys and values as the API server validates them (a qualified name; a value of 63 characters at most).
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_KEY = re.compile(rf"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_NAME}")
_VALUE = re.compile(f"({_NAME})?")
_TOKEN = re.compile(r"\s*(!=|==|=|!|\(|\)|,|>|<|[^\s!=(),<>]+)")
_SET_OPERATORS = ("in", "notin")


def parse_selector(text: str) -> Selector:
    """A selector in `kubectl -l`'s grammar; ValueError for anything else."""
    if not text.strip():
        return Selector()
    return Selector(tuple(_Parser(text).requirements()))


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[str] = []
        position = 0
        while position < len(text.rstrip()):
            token = _TOKEN.match(text, position)
            assert token is not None  # the pattern matches any non-blank character
            self.tokens.append(token.group(1))
            position = token.end()
        self.position = 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"discovery selector {self.text!r}: {what} (a Kubernetes label selector: "
                          "key, !key, key=value, key!=value, key in (a,b), key notin (a,b))")

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str | None:
        token = self.peek()
        self.position += 1
        return token

    def requirements(self) -> list[Requirement]:
        result = [self.requirement()]
        while self.peek() is not None:
            if self.take() != ",":
                raise self.error(f"expected ',' after {result[-1].key!r}")
            result.append(self.requirement())
        return result

    def requirement(self) -> Requirement:
        if self.peek() in (",", None):
            raise self.error("has an empty term")
        if self.peek() == "!":
            self.take()
            return Requirement(self.key(), "!")
        key = self.key()
        operator = self.peek()
        if operator in (",", None):
            return Requirement(key, "exists")
        self.take()
        if operator in ("=", "==", "!="):
            return Requirement(key, "!=" if operator == "!=" else "=", (self.value(),))
        if operator in _SET_OPERATORS:
            return Requirement(key, operator, self.value_set(key))
        if operator in (">", "<"):
            number = self.take() or ""
            if not re.fullmatch(r"-?\d+", number):
                raise self.error(f"{key}{operator} needs an integer, not {number!r}")
            return Requirement(key, operator, (number,))
        raise self.error(f"unknown operator {operator!r} after {key!r}")

    def key(self) -> str:
        key = self.take() or ""
        if not _KEY.fullmatch(key) or len(key.rpartition("/")[2]) > 63:
            raise self.error(f"{key!r} is not a valid label key")
        return key

    def value(self) -> str:
        value = "" if self.peek() in (",", ")", None) else self.take() or ""
        if not _VALUE.fullmatch(value) or len(value) > 63:
            raise self.error(f"{value!r} is not a valid label value")
        return value

    def value_set(self, key: str) -> tuple[str, ...]:
        if self.take() != "(":
            raise self.error(f"'{key} in' and 'notin' need a list in parentheses, like (a,b)")
        values = [self.value()]
        while self.peek() == ",":
            self.take()
            values.append(self.value())
        if self.take() != ")":
            raise self.error(f"the list after {key!r} is not closed with ')'")
        if values == [""]:
            raise self.error(f"the list after {key!r} is empty")
        return tuple(values)


@dataclass
class NamespaceFilter:
    selectors: tuple[Selector, ...] = ()
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

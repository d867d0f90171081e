"""Kubernetes label selectors as values: requirements that must all hold.

One shape for every selector istiod evaluates: a `--discovery-selector` flag parsed from
`kubectl -l` text (istiod/sources/namespaces.py) and the mesh config's `discoverySelectors`
(matchLabels and matchExpressions, istiod/sources/meshconfig.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# matchExpressions' operators in the text grammar's words.
EXPRESSION_OPERATORS = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str  # exists, !, =, !=, in, notin, >, <
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        match self.operator:
            case "exists":
                return value is not None
            case "!":
                return value is None
            case "=" | "in":
                return value in self.values
            case "!=" | "notin":
                return value not in self.values
        # > and <: a label that is not an integer matches neither, as in Kubernetes.
        try:
            number = int(value or "")
        except ValueError:
            return False
        return number > int(self.values[0]) if self.operator == ">" else number < int(self.values[0])


@dataclass(frozen=True, slots=True)
class Selector:
    requirements: tuple[Requirement, ...] = ()  # none: everything, as an empty selector in Kubernetes

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)

"""YAML from untrusted files, within bounds, and the bound on how far a value expands.

YAML aliases let a few hundred bytes describe a tree of billions of values: PyYAML builds it as
shared references, cheaply, and whatever walks it later (comparison, conversion, JSON for the debug
endpoints) expands it. Go's YAML library, which the API server uses, refuses such documents
("excessive aliasing"); so do we, before anything walks them. An alias may also point at its own
ancestor, making a cycle: that never ends expanding, and is refused by the same count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# Values a file may expand to beyond one per byte it has: room for anchors and merge keys as
# people write them, far below what would stall the event loop.
ALIAS_ALLOWANCE = 100_000
# Deeper than any Kubernetes object; well inside Python's recursion limit for those who walk it.
MAX_DEPTH = 200


class LimitError(ValueError):
    pass


def load_documents(text: str) -> list[Any]:
    """Every non-empty document of a YAML stream; raises yaml.YAMLError or LimitError."""
    documents = [doc for doc in yaml.load_all(text, Loader=_Loader) if doc is not None]
    limit = ALIAS_ALLOWANCE + len(text)
    if count_values(documents, limit) > limit:
        raise LimitError(f"it expands to more than {limit} values or {MAX_DEPTH} levels (aliases, or a cycle); refused")
    return documents


def count_values(value: Any, limit: int) -> int:
    """How many values `value` expands to, shared references counted each time they appear, and
    nesting deeper than MAX_DEPTH counted as over: stops at limit + 1, so a cycle ends too."""
    count = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > limit or depth > MAX_DEPTH:
            return limit + 1
        if isinstance(item, Mapping):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return count

"""YAML from untrusted files: what aliases and nesting may expand to (hypothesis for the count)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from istiod.sources.yamldocs import ALIAS_ALLOWANCE, MAX_DEPTH, LimitError, count_values, load_documents

scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=5)
trees = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
                     max_leaves=40)


def nodes(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + sum(nodes(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(nodes(v) for v in value)
    return 1


@given(trees)
def test_a_tree_counts_each_value_once_and_loads_back(tree: Any) -> None:
    assert count_values(tree, 10_000) == nodes(tree)
    assert load_documents(yaml.safe_dump(tree)) == ([tree] if tree is not None else [])


@given(trees, st.integers(min_value=0, max_value=20))
def test_the_count_stops_past_the_limit(tree: Any, limit: int) -> None:
    assert count_values(tree, limit) == min(nodes(tree), limit + 1)


def test_aliases_within_bounds_load_and_bombs_do_not() -> None:
    assert load_documents("a: &a {x: 1}\nb: *a\nc: {<<: *a, y: 2}\n") == [{"a": {"x": 1}, "b": {"x": 1}, "c": {"x": 1, "y": 2}}]
    levels = "".join(f"l{i + 1}: &l{i + 1} [{', '.join([f'*l{i}'] * 10)}]\n" for i in range(5))
    bomb = "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n" + levels  # 10^6 values from a few hundred bytes
    assert count_values(yaml.safe_load(bomb), 10**7) > ALIAS_ALLOWANCE + len(bomb)
    with pytest.raises(LimitError, match="it expands to more than"):
        load_documents(bomb)
    with pytest.raises(LimitError):
        load_documents("a: &a [*a]\n")  # a cycle


def test_nesting_through_aliases_is_bounded() -> None:
    chain = "l0: &l0 [x]\n" + "".join(f"l{i + 1}: &l{i + 1} [*l{i}]\n" for i in range(MAX_DEPTH + 5))
    with pytest.raises(LimitError):
        load_documents(chain)

"""Any object of an Istio kind either converts or is refused with ConversionError: never another
exception (which would stop a source or fail a webhook call with a 500)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from istiod.sources.convert import ConversionError, convert

VALID = list(yaml.safe_load_all((Path(__file__).parent / "data" / "istio" / "valid.yaml").read_text()))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-70000, 70000), st.floats(allow_nan=False),
                    st.text(max_size=12), st.sampled_from(["*", "1s", "-1s", "a/b", "10.0.0.0/8", "STRICT", "v1"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.one_of(st.text(max_size=8), st.integers(0, 99999)), inner, max_size=3)),
                      max_leaves=8)


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(obj, dict):
        for key, value in obj.items():
            found += paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            found += paths(value, prefix + (i,))
    return found


def converts_or_refuses(body: dict[str, Any]) -> None:
    try:
        convert(body)
    except ConversionError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(range(len(VALID))), st.data(), values)
def test_any_field_replaced_by_anything(index: int, data: st.DataObject, value: Any) -> None:
    body = copy.deepcopy(VALID[index])
    path = data.draw(st.sampled_from([p for p in paths(body["spec"]) if p]))
    target = body["spec"]
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    converts_or_refuses(body)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted({o["kind"] for o in VALID})), values)
def test_any_spec(kind: str, spec: Any) -> None:
    converts_or_refuses({"kind": kind, "metadata": {"name": "x", "namespace": "y"}, "spec": spec})

"""Kubernetes strategic merge patch, for the kinds istiod patches with a ConfigMap's overlays (the
objects of a deployed Gateway): a patch merges into the original map by map, lists with a merge key
merge element by element (matched on that key), other lists are replaced, and `null` deletes.

The directives Kubernetes defines are followed: `$patch: replace` / `delete` on a map or a list
element, `$retainKeys`, `$setElementOrder/<list>` and `$deleteFromPrimitiveList/<list>`. Which
lists merge and by which key is Kubernetes' (the `patchMergeKey` of its Go types), listed below for
the fields these kinds have; a list not listed is replaced, as Kubernetes does for atomic lists.
No Python library does this (the Kubernetes clients leave it to the API server's PATCH, which only
patches objects that already exist).

Pure: maps in, a new map out; the inputs are not changed. Raises PatchError naming the field.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_PATCH, _RETAIN = "$patch", "$retainKeys"
_ORDER, _DELETE_PRIMITIVE = "$setElementOrder/", "$deleteFromPrimitiveList/"


class PatchError(ValueError):
    """A patch Kubernetes would refuse, in one line naming the field."""


@dataclass(frozen=True, slots=True)
class MergeList:
    """A list merged element by element: maps matched on `key`, or, without one, a set of scalars."""

    key: str | None
    element: Mapping[str, Any] = field(default_factory=dict)  # the schema of each element (a map)


Schema = Mapping[str, Any]  # field -> a nested Schema (a map) or a MergeList

_META: Schema = {"ownerReferences": MergeList("uid"), "finalizers": MergeList(None)}
_CONTAINER: Schema = {"ports": MergeList("containerPort"), "env": MergeList("name"),
                      "volumeMounts": MergeList("mountPath"), "volumeDevices": MergeList("devicePath")}
_POD_SPEC: Schema = {
    "containers": MergeList("name", _CONTAINER), "initContainers": MergeList("name", _CONTAINER),
    "ephemeralContainers": MergeList("name", _CONTAINER), "volumes": MergeList("name"),
    "imagePullSecrets": MergeList("name"), "hostAliases": MergeList("ip"),
    "topologySpreadConstraints": MergeList("topologyKey"), "resourceClaims": MergeList("name"),
    "schedulingGates": MergeList("name"),
}
SCHEMAS: Mapping[str, Schema] = {
    "Deployment": {"metadata": _META, "spec": {"template": {"metadata": _META, "spec": _POD_SPEC}}},
    "Service": {"metadata": _META, "spec": {"ports": MergeList("port")}},
    "ServiceAccount": {"metadata": _META, "secrets": MergeList("name"), "imagePullSecrets": MergeList("name")},
    "HorizontalPodAutoscaler": {"metadata": _META},
    "PodDisruptionBudget": {"metadata": _META},
}


def strategic_merge(original: Mapping[str, Any], patch: Mapping[str, Any], schema: Schema) -> dict[str, Any]:
    """`patch` merged into `original` as the API server's strategic merge PATCH would."""
    merged = _merge_map(original, patch, schema, "")
    if merged is None:
        raise PatchError("the patch deletes the whole object")
    return merged


def _merge_map(original: Mapping[str, Any], patch: Mapping[str, Any], schema: Schema, path: str) -> dict[str, Any] | None:
    directive = patch.get(_PATCH)
    if directive == "delete":
        return None
    if directive == "replace":
        return _clean({k: v for k, v in patch.items() if k != _PATCH}, path)
    if directive is not None:
        raise PatchError(f"{path or '.'}: unknown {_PATCH} directive {directive!r}")
    out = copy.deepcopy(dict(original))
    for key, value in patch.items():
        where = f"{path}.{key}" if path else key
        if key.startswith("$"):
            if key != _RETAIN and not key.startswith((_ORDER, _DELETE_PRIMITIVE)):
                raise PatchError(f"{where}: unknown directive")
            continue
        if value is None:
            out.pop(key, None)
            continue
        sub = schema.get(key)
        current = out.get(key)
        if isinstance(sub, MergeList) and isinstance(value, list):
            out[key] = _merge_list(current if isinstance(current, list) else [], value, sub, where)
        elif isinstance(value, Mapping) and isinstance(current, Mapping):
            merged = _merge_map(current, value, sub if isinstance(sub, Mapping) else {}, where)
            if merged is None:
                out.pop(key, None)
            else:
                out[key] = merged
        else:
            out[key] = _clean(value, where)
    for key, value in patch.items():
        if key.startswith(_DELETE_PRIMITIVE):
            name = key[len(_DELETE_PRIMITIVE):]
            gone = _list(value, f"{path}.{key}")
            out[name] = [item for item in out.get(name) or [] if item not in gone]
        elif key.startswith(_ORDER):
            name = key[len(_ORDER):]
            sub = schema.get(name)
            out[name] = _ordered(out.get(name) or [], _list(value, f"{path}.{key}"),
                                 sub.key if isinstance(sub, MergeList) else None)
    if _RETAIN in patch:
        retained = set(_list(patch[_RETAIN], f"{path}.{_RETAIN}"))
        out = {k: v for k, v in out.items() if k in retained}
    return out


def _merge_list(original: list[Any], patch: list[Any], merge: MergeList, path: str) -> list[Any]:
    if merge.key is None:  # a set of scalars: the patch's added after the original's
        return [*original, *(item for item in patch if item not in original)]
    key = merge.key
    if any(isinstance(item, Mapping) and item.get(_PATCH) == "replace" for item in patch):
        return [_clean(item, path) for item in patch if not (isinstance(item, Mapping) and item.get(_PATCH) == "replace")]
    out = [copy.deepcopy(item) for item in original]
    for item in patch:
        if not isinstance(item, Mapping):
            raise PatchError(f"{path}: an element is not a map")
        if key not in item:
            raise PatchError(f"{path}: an element does not contain the merge key {key!r}")
        index = next((i for i, existing in enumerate(out)
                      if isinstance(existing, Mapping) and existing.get(key) == item[key]), None)
        if item.get(_PATCH) == "delete":
            out = [e for e in out if not (isinstance(e, Mapping) and e.get(key) == item[key])]
        elif index is None:
            out.append(_clean(item, path))
        else:
            merged = _merge_map(out[index], item, merge.element, f"{path}[{key}={item[key]}]")
            if merged is None:
                del out[index]
            else:
                out[index] = merged
    return out


def _ordered(items: list[Any], order: Sequence[Any], key: str | None) -> list[Any]:
    """`items` in `order` (by merge key, or by value for scalars); those it does not name last."""
    def rank(item: Any) -> int:
        value = item.get(key) if key is not None and isinstance(item, Mapping) else item
        named = [o.get(key) if key is not None and isinstance(o, Mapping) else o for o in order]
        return named.index(value) if value in named else len(named)
    return sorted(items, key=rank)


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise PatchError(f"{where}: must be a list")
    return value


def _clean(value: Any, where: str) -> Any:
    """A value the original did not have: taken whole, without directives (a new map's nulls dropped)."""
    if isinstance(value, Mapping):
        return {k: _clean(v, f"{where}.{k}") for k, v in value.items() if not k.startswith("$") and v is not None}
    if isinstance(value, list):
        return [_clean(item, where) for item in value]
    return value

"""Envoy's message types by name, loaded on demand from xds-protos.

A `typed_config` in JSON or YAML (an EnvoyFilter's patch, a config dump) names its type by URL; the
protobuf runtime finds it only once the module declaring it was imported, and xds-protos has one
module per proto file, not per message. Importing every module of the type's package (a few) makes
it known, as Istio's istiod has every type compiled in.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from typing import Any

from google.protobuf import descriptor_pool


def load(type_name: str) -> bool:
    """Whether `type_name` (`envoy.extensions.filters.http.lua.v3.Lua`) is known, once loaded."""
    pool = descriptor_pool.Default()
    with contextlib.suppress(KeyError):
        pool.FindMessageTypeByName(type_name)
        return True
    package = type_name.rsplit(".", 1)[0]
    with contextlib.suppress(ImportError):
        module = importlib.import_module(package)
        for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
            if info.name.endswith("_pb2"):
                importlib.import_module(f"{package}.{info.name}")
    with contextlib.suppress(KeyError):
        pool.FindMessageTypeByName(type_name)
        return True
    return False


def named_types(value: Any) -> Iterator[str]:
    """The type names of every `@type` in a JSON value (the Anys it holds, nested ones too)."""
    if isinstance(value, Mapping):
        if isinstance(url := value.get("@type"), str):
            yield url.rsplit("/", 1)[-1]
        for item in value.values():
            yield from named_types(item)
    elif isinstance(value, list):
        for item in value:
            yield from named_types(item)

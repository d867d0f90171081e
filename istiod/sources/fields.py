"""What every conversion reads objects with: an object's identity, and typed reads of its fields
whose errors name the object and the field. Shared by the Kubernetes kinds (convert.py) and Istio's
(istio/), which convert.py dispatches to."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ConversionError(ValueError):
    pass


class FieldTypeError(ConversionError):
    """A field of the wrong type: the object does not parse (as Istio's JSON decoding refuses it),
    as opposed to a parsed object that fails validation."""


@dataclass(frozen=True, slots=True, order=True)
class ObjectKey:
    kind: str
    namespace: str  # "" for cluster-scoped kinds
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}" if self.namespace else f"{self.kind} {self.name}"


class _Fields:
    """Typed reads from one object's dict, with errors that name the object and the field."""

    def __init__(self, key: ObjectKey | str, body: Mapping[str, Any]) -> None:
        self.key = key
        self.body = body

    def fail(self, message: str, error: type[ConversionError] = ConversionError) -> ConversionError:
        return error(f"{self.key}: {message}")

    def get(self, path: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value: Any = self.body
        for part in path.split("."):
            if not isinstance(value, Mapping):
                raise self.fail(f"{path}: expected a map above {part!r}", FieldTypeError)
            value = value.get(part)
            if value is None:
                return default
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise self.fail(f"{path}: expected {expected}, got {type(value).__name__}", FieldTypeError)
        return value

    def ip(self, path: str, value: str, version: int | None = None) -> str:
        """`value` as the API server accepts an IP (no zone, no leading zeros), of `version` if given."""
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            address = None
        if address is None or "%" in value or version is not None and address.version != version:
            kind = f"an IPv{version}" if version else "an IP"
            raise self.fail(f"{path}: {value!r} is not {kind} address")
        return value

    def str_map(self, path: str) -> tuple[tuple[str, str], ...]:
        value = self.get(path, dict, {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise self.fail(f"{path}: keys and values must be strings", FieldTypeError)
        return tuple(sorted(value.items()))

    def items(self, path: str) -> list[_Fields]:
        """A list of maps, each readable with errors that name its index."""
        result = []
        for i, item in enumerate(self.get(path, list, [])):
            if not isinstance(item, Mapping):
                raise self.fail(f"{path}[{i}]: expected a map", FieldTypeError)
            result.append(_Fields(f"{self.key} {path}[{i}]", item))
        return result

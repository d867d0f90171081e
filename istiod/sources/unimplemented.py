"""Objects of Istio's kinds this istiod does not implement (EnvoyFilter, Telemetry, ...), read from a
cluster only to say so: one warning line per object and generation, so an operator moving from
Istio's istiod learns which of their objects have no effect here rather than finding out from traffic."""

from __future__ import annotations

import logging
from typing import Any

from istiod import logs
from istiod.model.config.kinds import unimplemented

log = logging.getLogger(__name__)


class UnimplementedReporter:
    """An informer's writer: remembers which objects it warned of, and at which generation."""

    def __init__(self) -> None:
        self._told: dict[tuple[str, str, str], object] = {}

    def apply(self, body: dict[str, Any]) -> object:
        key, generation = _key(body), (body.get("metadata") or {}).get("generation")
        reason = unimplemented(key[0], str(body.get("apiVersion", "")))
        if reason is not None and self._told.get(key) != generation:
            self._told[key] = generation
            log.warning(logs.event("config not implemented", object=f"{key[0]}/{key[1]}/{key[2]}", reason=reason))
        return None

    def delete(self, body: dict[str, Any]) -> None:
        self._told.pop(_key(body), None)

    def replace(self, kind: str, items: list[dict[str, Any]]) -> None:
        listed = set()
        for item in items:
            body = {"kind": kind, **item}
            self.apply(body)
            listed.add(_key(body))
        for key in [k for k in self._told if k[0] == kind and k not in listed]:
            del self._told[key]


def _key(body: dict[str, Any]) -> tuple[str, str, str]:
    metadata = body.get("metadata") or {}
    return str(body.get("kind", "")), str(metadata.get("namespace", "")), str(metadata.get("name", ""))

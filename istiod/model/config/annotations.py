"""Istio's annotation table (istio.io/api's annotations.yaml), as annotations.json holds it;
api/annotations/generate.py writes that file from Istio's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Annotation:
    name: str
    deprecated: bool
    feature_status: str
    resources: tuple[str, ...]  # the kinds it applies to; "Any" for every kind


def _load() -> dict[str, Annotation]:
    table = json.loads((Path(__file__).parent / "annotations.json").read_text())
    return {e["name"]: Annotation(e["name"], e["deprecated"], e["featureStatus"], tuple(e["resources"]))
            for e in table["annotations"]}


ANNOTATIONS = _load()

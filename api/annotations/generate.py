"""Writes istiod/model/config/annotations.json from Istio's annotation table (istio.io/api's
annotation/annotations.yaml, the file its annotations.gen.go is generated from).

    python3 api/annotations/generate.py [path/to/annotations.yaml]

Without a path, the istio.io/api module in the Go module cache is read."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[2] / "istiod" / "model" / "config" / "annotations.json"


def table(source: Path) -> list[dict[str, object]]:
    """What the analyzers read of each annotation: name, deprecated, feature status, resources."""
    entries = yaml.safe_load(source.read_text())["annotations"]
    return [{"name": e["name"], "deprecated": bool(e.get("deprecated")),
             "featureStatus": e.get("featureStatus", ""), "resources": list(e.get("resources") or [])}
            for e in entries]


def default_source() -> Path:
    modules = os.path.expanduser(os.environ.get("GOMODCACHE", "~/go/pkg/mod"))
    found = sorted(glob.glob(f"{modules}/istio.io/api@*/annotation/annotations.yaml"))
    if not found:
        sys.exit(f"no istio.io/api module under {modules}: pass annotations.yaml's path")
    return Path(found[-1])


def render(source: Path) -> str:
    return json.dumps({"source": f"istio.io/{source.parent.parent.name}/annotation/annotations.yaml",
                       "annotations": table(source)}, indent=1) + "\n"


if __name__ == "__main__":
    OUT.write_text(render(Path(sys.argv[1]) if len(sys.argv) > 1 else default_source()))

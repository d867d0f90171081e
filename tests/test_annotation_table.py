"""annotations.json is what api/annotations/generate.py makes of Istio's annotation table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_is_istios() -> None:
    spec = importlib.util.spec_from_file_location("generate", ROOT / "api" / "annotations" / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    source = generate.default_source()
    assert generate.OUT.read_text() == generate.render(source)

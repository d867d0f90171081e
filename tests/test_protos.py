"""The generated code under istiod/gen is committed; it must be what `make protos` makes now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.peers import ROOT


def test_generated_code_is_current(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "api").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iistiod/gen=api", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos],
        cwd=ROOT, check=True, timeout=60,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "protoc generated nothing"
    stale = [str(p) for p in generated if not (ROOT / p).exists() or (ROOT / p).read_bytes() != (tmp_path / p).read_bytes()]
    assert not stale, f"run `make protos`: these differ from what protoc generates now: {stale}"

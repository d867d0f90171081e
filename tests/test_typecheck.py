"""`make test` type-checks istiod/ (mypy, configured in pyproject.toml) as part of the suite."""

from __future__ import annotations

import subprocess
import sys

from tests.peers import ROOT


def test_istiod_is_mypy_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(result.stdout[-2000:])
    assert result.returncode == 0, result.stdout + result.stderr

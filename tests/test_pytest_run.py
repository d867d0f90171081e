"""The repository's conftest.py, in a pytest run of its own: what a failure or a skip does to the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.peers import ROOT

# A failure reported while the collector keeps finding garbage whose finalizer fails (pytest formats
# the traceback at once, parsing source for its carets): on Python 3.11 without the conftest's guard,
# pytest's report of the failure, which parses the module (made long here so that the collector runs
# during that parse), ends the run with "INTERNALERROR> SystemError: AST constructor recursion depth
# mismatch" and test_after never runs.
FAILURE_BESIDE_GARBAGE = f'''
import gc

class Closes:
    left = 5000

    def __init__(self):
        self.table = {{}}
        self.me = self  # a cycle: only the collector frees it

    def __del__(self):
        if Closes.left:  # garbage for the next collection too, so there is always some
            Closes.left -= 1
            Closes()
        self.table["missing"] + 1

def test_fails_while_garbage_waits():
    gc.set_threshold(10)
    Closes()
    assert {{"a": [1, 2, {{"b": 3}}]}} == {{"a": [1, 2, {{"b": 4}}]}}

def test_after():
    pass

def test_skips():
    import pytest
    pytest.skip("no peer here")

LONG = {list(range(3000))}
'''


def run(tmp_path: Path, ci: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(FAILURE_BESIDE_GARBAGE)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-p", "conftest", "test_inner.py"],
        cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "CI": ci, "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )


def test_a_failure_beside_failing_finalizers_is_reported_and_the_run_goes_on(tmp_path: Path) -> None:
    done = run(tmp_path, ci="")
    assert "INTERNALERROR" not in done.stdout + done.stderr, done.stdout
    assert "FAILED test_inner.py::test_fails_while_garbage_waits - AssertionError" in done.stdout
    assert "SKIPPED [1] test_inner.py:27: no peer here" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("1 failed, 1 passed, 1 skipped"), done.stdout
    assert done.returncode == 1


def test_in_ci_a_skip_is_a_failure_with_its_reason(tmp_path: Path) -> None:
    done = run(tmp_path, ci="true")
    assert "FAILED test_inner.py::test_skips - skipped in CI, where every test must run: " in done.stdout
    assert "test_inner.py:27: Skipped: no peer here" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("2 failed, 1 passed"), done.stdout

"""What every pytest run of this repository (tests/ and e2e/) shares: loaded before either's conftest.

- Python 3.11's `ast.parse` can fail with "SystemError: AST constructor recursion depth mismatch"
  (CPython gh-106905): the AST constructor keeps its depth in per-interpreter state, and a garbage
  collection during construction runs finalizers, which may parse too (pytest's unraisable-exception
  hook and 3.11's traceback carets both call `ast.parse`) or hand the GIL to a thread that does. Pytest
  parses a failed test's source to report it, so one failure beside such garbage ended the whole run
  with an INTERNALERROR. Here `ast.parse` runs with the collector paused: no Python code runs inside
  it, so nothing else can parse meanwhile. Python 3.12 collects only between bytecodes: not needed.
- With CI set, a skipped test fails, with the skip's reason: a test that needs a real peer (Envoy,
  gRPC, iptables, kube-apiserver, ztunnel) and does not find it proves nothing.
- A run that does end with an INTERNALERROR still names the tests that failed before it.
"""

from __future__ import annotations

import ast
import gc
import os
import sys
import threading
from collections.abc import Callable, Generator
from typing import Any

import pytest


def _without_collection(parse: Callable[..., Any]) -> Callable[..., Any]:
    lock = threading.Lock()
    parsing = 0  # parses under way (in any thread); the collector is paused while there are any
    resume = False

    def parse_paused(*args: Any, **kwargs: Any) -> Any:
        nonlocal parsing, resume
        with lock:
            if parsing == 0:
                resume = gc.isenabled()
                gc.disable()
            parsing += 1
        try:
            return parse(*args, **kwargs)
        finally:
            with lock:
                parsing -= 1
                if parsing == 0 and resume:
                    gc.enable()

    return parse_paused


if sys.version_info < (3, 12):
    ast.parse = _without_collection(ast.parse)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # (file, line, "Skipped: <reason>")
        return f"{longrepr[0]}:{longrepr[1]}: {longrepr[2]}"
    return str(longrepr)


def _fail_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if _in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every test must run: {_skip_reason(report)}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
        item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _fail_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
        collector: pytest.Collector) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _fail_skip(report)
    return report


_running: list[str] = []  # the test under way, for the message after an INTERNALERROR


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _running[:] = [nodeid]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Pytest prints no summary after an INTERNALERROR: name what failed before it, and where it hit."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if exitstatus != pytest.ExitCode.INTERNAL_ERROR or reporter is None:
        return
    for outcome in ("failed", "error"):
        for report in reporter.stats.get(outcome, []):
            reporter.write_line(f"{outcome.upper()} {report.nodeid} (before the INTERNALERROR)")
    if _running:
        reporter.write_line(f"INTERNALERROR in {_running[0]}; it and the tests after it did not finish")

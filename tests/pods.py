"""Pods with sidecars for tests: network namespaces (istiod.demo.pods), their apps and Envoys.

Everything a test starts here is removed even on failure: fixtures delete what they made, and a
sweep removes `sp-` namespaces that a killed earlier run left behind.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from istiod.demo.pods import Netns, missing_privileges, sweep
from tests.peers import Process, wait_until

requires_root = pytest.mark.skipif(bool(missing_privileges()), reason=missing_privileges() or "root")


@contextlib.contextmanager
def netns(name: str) -> Iterator[Netns]:
    sweep()
    ns = Netns(name)
    try:
        yield ns
    finally:
        ns.delete()


def shared_dir(prefix: str) -> Path:
    """A directory uid 1337 can reach (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


def app(pod: Netns, *args: str, name: str, module: str = "istiod.demo.apps") -> Process:
    """`python -m <module> ...` inside the pod (an app, or a client that keeps calling)."""
    return Process(pod.exec_args(sys.executable, "-m", module, *args), name=name)


def call(pod: Netns, *args: str, timeout: float = 10) -> dict[str, Any]:
    """One call by `python -m istiod.demo.apps <kind> ...` from inside the pod: its JSON answer."""
    done = pod.run(sys.executable, "-m", "istiod.demo.apps", *args, timeout=timeout)
    try:
        return json.loads(done.stdout.splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "error": f"no answer: exit {done.returncode} {done.stdout!r} {done.stderr[-500:]!r}"}


def admin(pod: Netns, path: str) -> str:
    """GET on Envoy's admin port (127.0.0.1:15000 inside the pod)."""
    done = pod.run("curl", "-s", "--max-time", "5", f"http://127.0.0.1:15000{path}")
    return done.stdout


def stats(pod: Netns, contains: str) -> dict[str, int]:
    """Envoy's counters and gauges whose names contain `contains` (plain text, not a regex)."""
    values = {}
    for line in admin(pod, "/stats").splitlines():
        name, _, value = line.partition(": ")
        if contains in name and value.strip().isdigit():
            values[name] = int(value)
    return values


def uids(pid: int | str) -> list[str]:
    """A process's real, effective, saved and filesystem uids."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(line for line in status if line.startswith("Uid:")).split()[1:]


def wait_serving(process: Process, timeout: float = 20) -> dict[str, Any]:
    first = process.next_json(timeout)
    assert "serving" in first, process.log()
    return first


def wait_envoy_ready(pod: Netns, process: Process, timeout: float = 30) -> None:
    wait_until(lambda: admin(pod, "/ready").strip() == "LIVE" or process.proc.poll() is not None,
               timeout, f"Envoy in {pod.name} to be ready")
    assert process.proc.poll() is None, f"Envoy exited: {process.log()}"

"""The load benchmark (bench/load.py) still works: a tiny run against a real istiod it starts itself.

Checks what the clients got, never how fast: every client configured, every change held.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "bench" / "load.py"


def test_tiny_run_configures_every_client_and_sees_every_change(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "-S", "6", "-P", "1", "-N", "4", "-K", "2", "--envoy", "2", "--delta",
         "--rate", "5", "--duration", "1", "--steady", "0.5", "--grace", "2", "--storm-timeout", "20",
         "--results", str(tmp_path)],
        capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "| endpoint churn" in run.stdout
    [result_file] = tmp_path.glob("load-*.json")
    result = json.loads(result_file.read_text())
    assert result["storm"]["all_configured"] and result["storm"]["not_configured"] == 0
    assert result["churn"]["changes"] == 5 and result["churn"]["never_seen"] == 0
    assert result["churn"]["latency"]["count"] > 0
    assert result["everyone"]["all_seen"] and result["everyone"]["never_seen"] == 0

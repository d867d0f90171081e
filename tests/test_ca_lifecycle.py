"""The CA over its lifetime, in a real istiod: expiry gauges from the start, the serving certificate's
renewal surviving failures, and the self-signed root's rotation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.peers import Istiod, metric


def test_expiry_gauges_are_set_at_start(mesh_dir: Path, start_istiod: Callable[..., Istiod]) -> None:
    """No CSR yet: alerts on the root's expiry must not read "expires now"."""
    samples = start_istiod(mesh_dir).metrics()
    ten_years = 3650 * 86400
    for name in ("citadel_server_root_cert_expiry_timestamp", "citadel_server_cert_chain_expiry_timestamp"):
        assert abs(metric(samples, name) - (time.time() + ten_years)) < 600, name
    for name in ("citadel_server_root_cert_expiry_seconds", "citadel_server_cert_chain_expiry_seconds"):
        assert abs(metric(samples, name) - ten_years) < 600, name
    print("root expires in", round(metric(samples, "citadel_server_root_cert_expiry_seconds") / 86400), "days")


def test_a_static_token_for_a_hostile_account_stops_the_start(tmp_path: Path, mesh_dir: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"s3cret": "ns/../sa/x"}))
    done = subprocess.run([sys.executable, "-m", "istiod", "discovery", "--config-dir", str(mesh_dir),
                           "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--monitoring-addr", "127.0.0.1:0",
                           "--secure-grpc-addr", "127.0.0.1:0", "--ca-state-dir", str(tmp_path / "state"),
                           "--ca-static-tokens", str(tokens)], capture_output=True, text=True, timeout=30)
    print(done.stderr)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "s3cret" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"istiod: cannot start the CA: static token file {tokens}: entry #1: service account '../sa/x' is not a DNS-1123 label")

"""The CA over its lifetime, in a real istiod: expiry gauges from the start, the serving certificate's
renewal surviving failures, and the self-signed root's rotation."""

from __future__ import annotations

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

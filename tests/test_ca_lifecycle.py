"""The CA over its lifetime, in a real istiod: expiry gauges from the start, the serving certificate's
renewal surviving failures, and the self-signed root's rotation."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cryptography import x509

from tests.peers import Istiod, Process, metric, wait_until


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


def serving_cert(istiod: Istiod) -> x509.Certificate:
    """The certificate istiod presents on 15012 to a new connection, from a real TLS handshake."""
    context = ssl.create_default_context(cafile=str(istiod.root_cert))
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # we look at it, whatever state it is in
    with socket.create_connection(("127.0.0.1", istiod.ports["secure-grpc"]), timeout=5) as sock:
        with context.wrap_socket(sock) as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def test_serving_certificate_renewal_survives_failures(tmp_path: Path, mesh_dir: Path, processes: list[Process]) -> None:
    """A 6 s serving certificate renewed at 3 s; renewals fail while istiod's temp dir is gone (a real
    transient fault: the key is handed to ssl through a private temp file). They are retried, logged
    and counted; /ready and the expiry gauge show the certificate running out; it recovers."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    istiod = Istiod(tmp_path, "--config-dir", str(mesh_dir), "--workload-cert-ttl", "6s", env={"TMPDIR": str(temp)})
    processes.append(istiod)
    first = serving_cert(istiod)
    shutil.rmtree(temp)
    status, body = wait_until(lambda: (r := istiod.get("/ready"))[0] == 503 and r, 10, "/ready to say the cert runs out")
    print("while renewal fails:", status, body.strip())
    assert "istiod's serving certificate expires at" in body and "was not renewed" in body
    samples = istiod.metrics()
    failures = metric(samples, "istiod_serving_cert_renewal_failures")
    expiry = metric(samples, "istiod_serving_cert_expiry_timestamp")
    print(f"failures={failures:g} expires_in={expiry - time.time():.1f}s")
    assert failures >= 1 and expiry == first.not_valid_after_utc.timestamp()
    assert "serving certificate renewal failed" in istiod.text()
    temp.mkdir()
    wait_until(lambda: istiod.get("/ready")[0] == 200, 20, "/ready again after a renewal")
    renewed = serving_cert(istiod)
    assert renewed.serial_number != first.serial_number and renewed.not_valid_after_utc > first.not_valid_after_utc
    assert metric(istiod.metrics(), "istiod_serving_cert_expiry_timestamp") >= renewed.not_valid_after_utc.timestamp()
    assert "serving certificate renewed" in istiod.text()


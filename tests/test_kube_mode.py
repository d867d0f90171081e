"""`istiod discovery` against a cluster, without one: flags refused up front, and the CA waiting for
its Secret while the API server does not answer, until a signal stops it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.peers import ROOT, Process, free_port, wait_until


def discovery(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "istiod", "discovery", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize("flags, message", [
    (("--ca-static-tokens", "tokens.json"),
     "istiod discovery: --ca-static-tokens is for --config-dir only; a cluster's tokens are checked with TokenReview"),
    (("--leader-renew-deadline", "30s"),
     "istiod discovery: leader election needs lease duration > renew deadline > 1.2 x retry period > 0"),
    (("--leader-retry-period", "13s"),
     "istiod discovery: leader election needs lease duration > renew deadline > 1.2 x retry period > 0"),
])
def test_bad_flags_are_refused(tmp_path: Path, flags: tuple[str, ...], message: str) -> None:
    refused = discovery("--kubeconfig", str(tmp_path / "kubeconfig"), *flags)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1] == message


def test_the_ca_waits_for_its_secret_until_stopped(tmp_path: Path, processes: list[Process]) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: gone, cluster: {{server: "https://127.0.0.1:{free_port()}", insecure-skip-tls-verify: true}}}}]
users: [{{name: u, user: {{token: "not-a-real-token"}}}}]
contexts: [{{name: gone, context: {{cluster: gone, user: u}}}}]
current-context: gone
""")
    istiod = Process([sys.executable, "-m", "istiod", "discovery", "--kubeconfig", str(kubeconfig),
                      "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--secure-grpc-addr", "127.0.0.1:0"],
                     name="istiod")
    processes.append(istiod)
    wait_until(lambda: istiod.text().count("CA root: cannot read or create Secret istio-system/istio-ca-secret") >= 2,
               20, "the CA to retry its Secret")
    assert "serving grpc=" not in istiod.text()  # no port opens before the CA has its root
    istiod.proc.send_signal(signal.SIGTERM)
    assert istiod.proc.wait(timeout=5) == 0
    assert "stopped while starting" in istiod.text() and "not-a-real-token" not in istiod.text()

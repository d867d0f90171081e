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
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from istiod.ca.pki import cert_pem, key_pem, load_certs, load_key, new_key, same_public_key, uri_sans
from istiod.ca.selfsigned import CA_SECRET, StoredRoot, self_signed_root
from tests.peers import Istiod, Process, eventually, metric, wait_until
from tests.pki import csr_pem
from tests.secure_port import TOKEN, CaEndpoint
from tests.test_ca_service import create


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
    """A 12 s serving certificate renewed at 6 s (6 s left room for a loaded machine to renew before
    the temp dir went, seen once); renewals fail while istiod's temp dir is gone (a real
    transient fault: the key is handed to ssl through a private temp file). They are retried, logged
    and counted; /ready and the expiry gauge show the certificate running out; it recovers."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    istiod = Istiod(tmp_path, "--config-dir", str(mesh_dir), "--workload-cert-ttl", "12s", env={"TMPDIR": str(temp)})
    processes.append(istiod)
    first = serving_cert(istiod)
    shutil.rmtree(temp)
    status, body = wait_until(lambda: (r := istiod.get("/ready"))[0] == 503 and r, 20, "/ready to say the cert runs out")
    print("while renewal fails:", status, body.strip())
    assert "istiod's serving certificate expires at" in body and "was not renewed" in body
    samples = istiod.metrics()
    failures = metric(samples, "istiod_serving_cert_renewal_failures", server="xds")
    expiry = metric(samples, "istiod_serving_cert_expiry_timestamp", server="xds")
    print(f"failures={failures:g} expires_in={expiry - time.time():.1f}s")
    assert failures >= 1 and expiry == first.not_valid_after_utc.timestamp()
    assert "serving certificate renewal failed" in istiod.text()
    temp.mkdir()
    wait_until(lambda: istiod.get("/ready")[0] == 200, 20, "/ready again after a renewal")
    renewed = serving_cert(istiod)
    assert renewed.serial_number != first.serial_number and renewed.not_valid_after_utc > first.not_valid_after_utc
    assert metric(istiod.metrics(), "istiod_serving_cert_expiry_timestamp", server="xds") >= renewed.not_valid_after_utc.timestamp()
    assert "serving certificate renewed" in istiod.text()



def plant_root(state_dir: Path, age: float, ttl: float) -> StoredRoot:
    """A self-signed root in the state dir as istiod stores it, made `age` seconds ago to live `ttl` seconds."""
    stored = self_signed_root("cluster.local", datetime.now(timezone.utc) - timedelta(seconds=age), timedelta(seconds=ttl))
    (state_dir / CA_SECRET).mkdir(parents=True)
    (state_dir / CA_SECRET / "ca-cert.pem").write_bytes(stored.cert)
    (state_dir / CA_SECRET / "ca-key.pem").write_bytes(stored.key)
    return stored


def start_with_tokens(tmp_path: Path, mesh_dir: Path, processes: list[Process], *extra: str) -> tuple[Istiod, CaEndpoint]:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({TOKEN: "app/web"}))
    istiod = Istiod(tmp_path, "--config-dir", str(mesh_dir), "--ca-static-tokens", str(tokens), *extra)
    processes.append(istiod)
    return istiod, CaEndpoint(istiod.secure_address, istiod.root_cert.read_bytes())


def verifies(leaf: x509.Certificate, root: x509.Certificate) -> bool:
    """As a TLS peer trusting only `root` would check `leaf` (RFC 5280 client profile)."""
    try:
        PolicyBuilder().store(Store([root])).build_client_verifier().verify(leaf, [])
    except VerificationError:
        return False
    return True


async def test_the_root_is_rotated_before_it_expires_and_both_are_trusted(
    tmp_path: Path, mesh_dir: Path, processes: list[Process], start_agent: Callable[..., Process]
) -> None:
    """A 100 s root, 70 s old: with istiod's 20% grace period it is due in 10 s. The new root has the same
    key and subject; both roots are published and handed to workloads, and each side verifies the other's."""
    old = load_certs(plant_root(tmp_path / "state", age=70, ttl=100).cert, "old root")[0]
    istiod, ca = start_with_tokens(tmp_path, mesh_dir, processes, "--self-signed-ca-cert-ttl", "100s",
                                   "--self-signed-root-cert-check-interval", "500ms")
    key = new_key()
    before = (await create(ca, csr_pem(key), token=TOKEN)).cert_chain
    assert load_certs(before[-1].encode(), "roots") == [old], "rotated already: istiod took 10 s to start"

    published = await eventually(lambda: len(roots := load_certs(istiod.root_cert.read_bytes(), "roots")) == 2 and roots,
                                 15, "two roots in the published root-cert.pem")
    new = published[0]
    print("rotated:", f"{old.serial_number:x} (expires {old.not_valid_after_utc}) ->",
          f"{new.serial_number:x} (expires {new.not_valid_after_utc})")
    assert published[1] == old and new.subject == old.subject and same_public_key(load_key(
        (tmp_path / "state" / CA_SECRET / "ca-key.pem").read_bytes(), "key"), new)
    assert new.not_valid_after_utc - old.not_valid_after_utc > timedelta(seconds=60)
    assert (tmp_path / "state" / CA_SECRET / "ca-cert.pem").read_bytes() == cert_pem(new).encode()
    assert "root CA rotated" in istiod.text()

    # A workload that still trusts only the old root reaches istiod; one trusting both gets both.
    ca.root = cert_pem(old).encode()
    after = (await create(ca, csr_pem(new_key()), token=TOKEN)).cert_chain
    assert load_certs(after[-1].encode(), "roots") == [new, old]
    old_leaf, new_leaf = (load_certs(chain[0].encode(), "leaf")[0] for chain in (before, after))
    assert verifies(old_leaf, new) and verifies(new_leaf, old) and verifies(new_leaf, new)
    # Renewal with a certificate from the old root is still accepted.
    renewed = await create(ca, csr_pem(new_key()), cert=(key_pem(key), "".join(before[:-1]).encode()))
    assert uri_sans(load_certs(renewed.cert_chain[0].encode(), "leaf")[0]) == ["spiffe://cluster.local/ns/app/sa/web"]
    assert metric(istiod.metrics(), "citadel_server_root_cert_expiry_timestamp") == new.not_valid_after_utc.timestamp()

    # The agent of a workload whose mounted root is still the old one writes both for its bootstrap.
    (tmp_path / "old-root.pem").write_bytes(cert_pem(old).encode())
    (tmp_path / "token").write_text(TOKEN)
    agent = start_agent("--ca-addr", istiod.secure_address, "--ca-root-cert", str(tmp_path / "old-root.pem"),
                        "--token-file", str(tmp_path / "token"), "--output-dir", str(tmp_path / "certs"),
                        "--bootstrap", str(tmp_path / "bootstrap.json"), "--pod-name", "web-1",
                        "--pod-namespace", "app", "--instance-ip", "127.0.0.5", "--service-account", "web")
    await eventually(lambda: (tmp_path / "bootstrap.json").exists() or agent.proc.poll() is not None, 20, "the bootstrap")
    assert load_certs((tmp_path / "certs" / "root-cert.pem").read_bytes(), "agent roots") == [new, old], agent.log()


async def test_an_expired_root_is_replaced_at_start_with_one_line_saying_so(
    tmp_path: Path, mesh_dir: Path, processes: list[Process]
) -> None:
    old = load_certs(plant_root(tmp_path / "state", age=200, ttl=100).cert, "old root")[0]
    istiod, ca = start_with_tokens(tmp_path, mesh_dir, processes)
    lines = [line for line in istiod.text().splitlines() if "expired at" in line]
    print("\n".join(lines))
    assert len(lines) == 1 and "level=warning" in lines[0] and "restart those that gave up" in lines[0]
    new = load_certs(istiod.root_cert.read_bytes(), "roots")
    assert len(new) == 1 and new[0].subject == old.subject and new[0].public_key() == old.public_key()
    assert new[0].not_valid_after_utc - datetime.now(timezone.utc) > timedelta(days=3649)
    chain = (await create(ca, csr_pem(new_key()), token=TOKEN)).cert_chain
    assert verifies(load_certs(chain[0].encode(), "leaf")[0], new[0])

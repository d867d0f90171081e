"""`istiod agent` in-process against istiod's real secure port: files, bootstrap, renewal at half
life, and clear errors when the CA refuses or cannot be reached."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509

from istiod.agent.agent import run
from istiod.agent.bootstrap import CertFiles, NodeInfo
from istiod.agent.settings import AgentSettings
from istiod.ca.pki import load_certs, uri_sans
from tests.peers import eventually, free_port
from tests.secure_port import TOKEN, Secure, start_secure


@pytest.fixture
async def secure(tmp_path: Path) -> AsyncIterator[Secure]:
    port = await start_secure(tmp_path / "istiod")
    yield port
    await port.port.stop()


def agent_settings(tmp_path: Path, ca_address: str, root: Path, token: str | None = TOKEN, ttl: float = 86400) -> AgentSettings:
    token_file = tmp_path / "token"
    if token is not None:
        token_file.write_text(token + "\n")
    return AgentSettings(
        ca_address=ca_address, ca_root_cert=root, token_file=token_file, certs=CertFiles(tmp_path / "certs", 1.0),
        bootstrap_file=tmp_path / "bootstrap.json", xds_address=ca_address,
        node=NodeInfo(ip="127.0.0.61", pod="web-1", namespace="app", service_account="web"), cert_ttl=ttl,
    )


@contextlib.asynccontextmanager
async def running(settings: AgentSettings) -> AsyncIterator[asyncio.Task[int]]:
    """The agent in this loop, stopped (and its clean exit checked) on the way out."""
    stop = asyncio.Event()
    agent = asyncio.create_task(run(settings, stop))
    try:
        yield agent
    finally:
        stop.set()
        assert await asyncio.wait_for(agent, 5) == 0


async def test_agent_writes_certificates_and_bootstrap(secure: Secure, tmp_path: Path) -> None:
    settings = agent_settings(tmp_path, secure.address, tmp_path / "istiod/state/root-cert.pem")
    certs = tmp_path / "certs"
    async with running(settings):
        await eventually(settings.bootstrap_file.exists, 10, "the bootstrap", interval=0.02)
    leaf = load_certs((certs / "cert-chain.pem").read_bytes(), "chain")
    assert len(leaf) == 1 and uri_sans(leaf[0]) == ["spiffe://cluster.local/ns/app/sa/web"]
    assert (certs / "root-cert.pem").read_bytes() == secure.root
    assert (certs / "key.pem").stat().st_mode & 0o777 == 0o600
    bootstrap = json.loads(settings.bootstrap_file.read_text())
    assert bootstrap["xds_servers"][0] == {
        "server_uri": secure.address, "server_features": ["xds_v3"],
        "channel_creds": [{"type": "tls", "config": {"certificate_file": str(certs / "cert-chain.pem"),
                                                     "private_key_file": str(certs / "key.pem"),
                                                     "ca_certificate_file": str(certs / "root-cert.pem")}}],
    }
    assert bootstrap["certificate_providers"]["default"] == {"plugin_name": "file_watcher", "config": {
        "certificate_file": str(certs / "cert-chain.pem"), "private_key_file": str(certs / "key.pem"),
        "ca_certificate_file": str(certs / "root-cert.pem"), "refresh_interval": "1s"}}
    assert bootstrap["node"]["id"] == "sidecar~127.0.0.61~web-1.app~app.svc.cluster.local"
    assert bootstrap["node"]["metadata"]["SERVICE_ACCOUNT"] == "web"
    assert bootstrap["server_listener_resource_name_template"] == "xds.istio.io/grpc/lds/inbound/%s"


async def test_agent_renews_at_half_life(secure: Secure, tmp_path: Path) -> None:
    settings = agent_settings(tmp_path, secure.address, tmp_path / "istiod/state/root-cert.pem", ttl=2)
    chain_file = tmp_path / "certs" / "cert-chain.pem"
    seen: dict[int, tuple[float, x509.Certificate]] = {}  # serial -> (wall-clock time first seen, certificate)

    def three_certificates() -> bool:
        if chain_file.exists():
            cert = load_certs(chain_file.read_bytes(), "chain")[0]
            seen.setdefault(cert.serial_number, (time.time(), cert))
        return len(seen) == 3

    async with running(settings):
        await eventually(three_certificates, 10, "two renewals", interval=0.02)
    history = sorted(seen.values(), key=lambda item: item[0])
    for (_, old), (replaced_at, new) in zip(history, history[1:]):
        assert (new.not_valid_after_utc - new.not_valid_before_utc).total_seconds() == 2
        half_life = (old.not_valid_before_utc + (old.not_valid_after_utc - old.not_valid_before_utc) / 2).timestamp()
        late = replaced_at - half_life
        print(f"renewed {late:+.3f}s after the previous certificate's half life")
        assert -0.05 < late < 0.5


async def test_refused_first_request_ends_the_agent(secure: Secure, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = agent_settings(tmp_path, secure.address, tmp_path / "istiod/state/root-cert.pem", token="wr0ng-t0ken")
    assert await asyncio.wait_for(run(settings, asyncio.Event()), 10) == 1
    assert (f"CA at {secure.address} refused the certificate request: UNAUTHENTICATED: request authenticate failure: "
            "StaticTokenAuthenticator: the token is not "
            "in the static token file") in caplog.text
    assert "wr0ng-t0ken" not in caplog.text and not settings.bootstrap_file.exists()


async def test_missing_token_file(secure: Secure, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = agent_settings(tmp_path, secure.address, tmp_path / "istiod/state/root-cert.pem", token=None)
    assert await asyncio.wait_for(run(settings, asyncio.Event()), 10) == 1
    assert f"cannot read the service account token {tmp_path / 'token'}: No such file or directory" in caplog.text


async def test_unreachable_ca_is_retried(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    secure = await start_secure(tmp_path / "istiod")  # only for a root to trust
    await secure.port.stop()
    settings = agent_settings(tmp_path, address, tmp_path / "istiod/state/root-cert.pem")
    async with running(settings):
        await eventually(lambda: len(re.findall(r"retrying in \d+(\.\d+)?s", caplog.text)) >= 2, 10, "a second retry",
                         interval=0.02)
    line = next(line for line in caplog.text.splitlines() if "is unreachable" in line)
    print(line)
    assert f"CA at {address} is unreachable: UNAVAILABLE: failed to connect to all addresses" in line
    assert re.search(r"; retrying in \d+(\.\d+)?s$", line)


async def test_a_ca_whose_certificate_does_not_name_the_address_says_what_to_change(
        secure: Secure, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """istiod's certificate has 127.0.0.1 (--tls-extra-san) but not `localhost`: the agent retries,
    and its line names the flag that fixes it."""
    address = secure.address.replace("127.0.0.1", "localhost")
    settings = agent_settings(tmp_path, address, tmp_path / "istiod/state/root-cert.pem")
    async with running(settings):
        await eventually(lambda: "retrying in" in caplog.text, 10, "a retry", interval=0.02)
    line = next(line for line in caplog.text.splitlines() if "is unreachable" in line)
    print(line)
    assert "Hostname Verification Check failed" in line
    assert ("; istiod's certificate does not name localhost: start istiod with --tls-extra-san localhost"
            " (ISTIOD_CUSTOM_HOST), or give --ca-addr a name it carries (istiod.istio-system.svc); retrying in") in line


async def test_agent_renews_with_its_certificate_when_the_token_is_gone(secure: Secure, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    # Renewal at half of 6s: room for a loaded machine, where 2s let the certificate expire first.
    settings = agent_settings(tmp_path, secure.address, tmp_path / "istiod/state/root-cert.pem", ttl=6)
    async with running(settings):
        await eventually(settings.bootstrap_file.exists, 10, "the bootstrap", interval=0.02)
        settings.token_file.unlink()
        await eventually(lambda: "(by ClientCertAuthenticator)" in caplog.text, 15, "a renewal by certificate",
                         interval=0.02)
    assert "CA: issued a certificate for spiffe://cluster.local/ns/app/sa/web (by ClientCertAuthenticator)" in caplog.text

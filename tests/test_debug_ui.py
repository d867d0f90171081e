"""/debug/ui rendered by headless Chromium: services, proxies and each proxy's sync state."""

from __future__ import annotations

import asyncio
import html
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from istiod.xds import types
from tests.ads_client import AdsClient
from tests.conftest import ECHO_HOST, ECHO_PORT, Mesh

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; `make chromium` installs it


def render_in_chromium(url: str, workdir: Path) -> str:
    """The DOM after the page's scripts ran (virtual time lets its fetches finish); saves ui.png."""
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: run `make chromium` (the test set-up installs it)"
    result = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-proxy-server",
         f"--user-data-dir={workdir / 'chromium-profile'}", f"--screenshot={workdir / 'ui.png'}",
         "--window-size=1280,900", "--virtual-time-budget=5000", "--dump-dom", url],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def row_texts(dom: str) -> list[str]:
    rows = re.findall(r"<tr>(.*?)</tr>", dom, flags=re.DOTALL)
    return [" ".join(html.unescape(re.sub(r"<[^>]+>", " ", row)).split()) for row in rows]


async def test_ui_shows_services_proxies_and_sync_states(
    synced_mesh: Mesh, ads_client: Callable[..., AdsClient], tmp_path: Path
) -> None:
    istiod = synced_mesh.istiod
    stale = ads_client(istiod, "stale", "echo-ns")  # is sent clusters and never answers: STALE
    stale.send(types.CLUSTER, [f"outbound|{ECHO_PORT}||{ECHO_HOST}"])
    await stale.receive()

    dom = await asyncio.to_thread(render_in_chromium, istiod.url() + "/debug/ui", tmp_path)
    print(f"screenshot: {tmp_path / 'ui.png'}")
    rows = row_texts(dom)
    print("\n".join(rows))
    status = re.search(r'<div id="status"[^>]*>(.*?)</div>', dom)
    assert status and status.group(1).startswith("1 service, 3 proxies; updated"), status
    assert "Proxy Cluster CDS LDS EDS RDS Address Connected since" in rows
    assert any(r.startswith("demo-client.echo-ns Kubernetes SYNCED SYNCED SYNCED SYNCED 127.0.0.1:") for r in rows)
    assert any(r.startswith("echo-a.echo-ns Kubernetes NOT SENT SYNCED NOT SENT NOT SENT 127.0.0.1:") for r in rows)
    assert any(r.startswith("stale.echo-ns Kubernetes STALE NOT SENT NOT SENT NOT SENT 127.0.0.1:") for r in rows)
    assert f"{ECHO_HOST} grpc:{ECHO_PORT}/TCP 0.0.0.0" in rows
    assert (tmp_path / "ui.png").stat().st_size > 10_000

"""The TLS front on 15012 under a burst of new connections: every handshake completes.

istiod runs on uvloop when it is installed (the test extras install it), and uvloop reads an accepted
socket before the front starts TLS on it; in such a burst about one connection in four has its
ClientHello read early, which the front must hand to the TLS handshake rather than lose.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from tests.conftest import render
from tests.peers import Istiod

CONNECTIONS = 600


async def _handshake(host: str, port: int, context: ssl.SSLContext) -> str:
    try:
        # A bound, not the measure: on a loaded machine the last of the burst's handshakes (both ends in
        # Python) finish long after the first.
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=context), 60)
    except (OSError, TimeoutError) as error:
        return type(error).__name__
    protocol = writer.get_extra_info("ssl_object").selected_alpn_protocol()
    writer.close()
    return f"ok {protocol}"


async def test_a_burst_of_tls_connections_all_complete_their_handshake(
    mesh_dir: Path, start_istiod: Callable[..., Istiod],
) -> None:
    (mesh_dir / "echo.yaml").write_text(render("service.yaml", name="echo", namespace="demo", port=7070))
    istiod = start_istiod(mesh_dir)
    context = ssl.create_default_context(cafile=str(istiod.root_cert))
    context.set_alpn_protocols(["h2"])
    host, port = istiod.secure_address.rsplit(":", 1)
    outcomes = Counter(await asyncio.gather(*(_handshake(host, int(port), context) for _ in range(CONNECTIONS))))
    assert outcomes == {"ok h2": CONNECTIONS}

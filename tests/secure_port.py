"""istiod's secure port in-process (real TLS, real gRPC), with the static-token stand-in."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from kubernetes_asyncio import client

from istiod.ca.settings import CaSettings
from istiod.ca.signer import TtlPolicy
from istiod.model.snapshot import Snapshot
from istiod.secure import SecurePort
from istiod.settings import Address, Settings
from istiod.xds.server import DiscoveryServer

TOKEN = "t0ken-web-5ecret"  # maps to app/web
OTHER_TOKEN = "t0ken-db-5ecret"  # maps to app/db


@dataclass
class CaEndpoint:
    """A secure port to call: its address and the root it chains to."""

    address: str
    root: bytes

    def channel(self, token: str | None = None, cert: tuple[bytes, bytes] | None = None,
                root: bytes | None = None) -> grpc.aio.Channel:
        """A TLS channel trusting istiod's root; optionally a token and a client (key, chain)."""
        creds = grpc.ssl_channel_credentials(root or self.root, *(cert or (None, None)))
        if token is not None:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        return grpc.aio.secure_channel(self.address, creds)


@dataclass
class Secure(CaEndpoint):
    """One started in this process."""

    port: SecurePort


async def start_secure(workdir: Path, ttl: TtlPolicy = TtlPolicy(), plugged: Path | None = None,
                       api: client.ApiClient | None = None, snapshot: Callable[[], Snapshot] = lambda: Snapshot("v1"),
                       tokens: Mapping[str, object] | None = None) -> Secure:
    """Config-dir mode (static tokens, root file in the state dir), or with `api` the cluster's (Secret,
    TokenReview; the ConfigMap publisher is not part of the port, so its root is not published).
    `snapshot`: the model the port reads; `tokens`: more static tokens (see StaticTokenAuthenticator)."""
    workdir.mkdir(parents=True, exist_ok=True)
    token_file = workdir / "tokens.json"
    token_file.write_text(json.dumps({TOKEN: "app/web", OTHER_TOKEN: "app/db", **(tokens or {})}))
    settings = Settings(
        config_dir=None, grpc_addr=Address("127.0.0.1", 0), http_addr=Address("127.0.0.1", 0),
        secure_grpc_addr=Address("127.0.0.1", 0),
        ca=CaSettings(state_dir=workdir / "state", plugged_dir=plugged, ttl=ttl, static_tokens=token_file,
                      extra_sans=("127.0.0.1",), reload_interval=0.1),
    )
    ads = DiscoveryServer(snapshot)
    ads.ready = True
    port = SecurePort(settings, ads, snapshot)
    if api is None:
        bound = await port.start()
        return Secure(f"127.0.0.1:{bound}", (workdir / "state" / "root-cert.pem").read_bytes(), port)
    bound = await port.start(api, lambda bundle: None)
    assert port.ca is not None
    return Secure(f"127.0.0.1:{bound}", port.ca.bundle.roots_pem.encode(), port)

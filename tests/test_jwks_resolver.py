"""The JWKS resolver with a fake fetcher: first fetch, istiod's background retries, refresh
keeping the last good keys on failure, eviction of URIs nobody names, and the fetch counters."""

from __future__ import annotations

import asyncio
import http.server
import logging
import threading
from collections.abc import Mapping

import pytest

from istiod.jwks import FETCH_FAIL, FETCH_SUCCESS, FetchError, JwksResolver, fetch
from istiod.model.config import ConfigSet
from istiod.model.config.common import Meta
from istiod.model.config.security import JWTRule, RequestAuthentication
from istiod.model.snapshot import Snapshot

GOOD = '{"keys": [{"kty": "oct", "k": "YQ"}]}'
ROTATED = '{"keys": [{"kty": "oct", "k": "Yg"}]}'


def snapshot(*uris: str) -> Snapshot:
    rules = tuple(JWTRule(f"issuer-{i}", jwks_uri=uri) for i, uri in enumerate(uris))
    inline = JWTRule("inline", jwks=GOOD, jwks_uri="https://inline.test/jwks")  # inline keys win: never fetched
    return Snapshot("1", config=ConfigSet(request_authentications=(
        RequestAuthentication(Meta("ra", "demo"), jwt_rules=(*rules, inline)),)))


async def test_fetch_retry_refresh_and_evict(caplog: pytest.LogCaptureFixture) -> None:
    served = {"https://a.test/jwks": GOOD}
    calls: list[str] = []
    pushed: list[Mapping[str, str]] = []

    def fetcher(uri: str, timeout: float) -> str:
        calls.append(uri)
        if uri not in served:
            raise FetchError("connection refused")
        return served[uri]

    failed, succeeded = FETCH_FAIL._value.get(), FETCH_SUCCESS._value.get()
    resolver = JwksResolver(pushed.append, refresh_interval=0.2, retry_interval=0.01, fetcher=fetcher)
    resolver.want(snapshot("https://a.test/jwks", "https://down.test/jwks"))
    task = asyncio.create_task(resolver.run())
    try:
        with caplog.at_level(logging.WARNING):
            await asyncio.sleep(0.15)
        assert pushed[0] == {"https://a.test/jwks": GOOD}
        # The unreachable URI: one try, then 7 more in the background, each counted; a line per round.
        assert calls.count("https://down.test/jwks") == 1 + 1 + 7
        assert "https://inline.test/jwks" not in calls
        assert FETCH_FAIL._value.get() - failed == 9 and FETCH_SUCCESS._value.get() - succeeded >= 1
        assert caplog.text.count("failed to fetch JWKS from https://down.test/jwks: connection refused") == 2
        # Rotation at the issuer reaches the next refresh; a failed refresh keeps the last good keys.
        resolver.want(snapshot("https://a.test/jwks"))
        served["https://a.test/jwks"] = ROTATED
        await asyncio.sleep(0.4)
        assert pushed[-1] == {"https://a.test/jwks": ROTATED}
        del served["https://a.test/jwks"]
        await asyncio.sleep(0.4)
        assert resolver.keys == {"https://a.test/jwks": ROTATED}
        # A URI no RequestAuthentication names any more is dropped.
        resolver.want(snapshot())
        assert resolver.keys == {}
    finally:
        task.cancel()


def test_fetch_refuses_what_envoy_would_not_take() -> None:
    with pytest.raises(FetchError, match="no_such_scheme|unknown url type"):
        fetch("no_such_scheme://x", 1.0)
    with pytest.raises(FetchError):
        fetch("http://127.0.0.1:1/jwks", 1.0)


def test_openid_discovery_without_jwks_uri_is_a_failed_fetch() -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"issuer": "x"}' if self.path.endswith("/openid-configuration") else b"{}"
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(FetchError, match="OpenID discovery document has no jwks_uri"):
            fetch(f"{base}/.well-known/openid-configuration", 2.0)
        with pytest.raises(FetchError, match="not a JSON Web Key Set Envoy accepts"):
            fetch(f"{base}/jwks", 2.0)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

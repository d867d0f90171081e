"""istiod's JWKS resolver: fetches the keys of RequestAuthentications' JWT rules that have none
inline (their `jwksUri`, else the `jwks_uri` of the issuer's OpenID discovery document,
`<issuer>/.well-known/openid-configuration`), keeps them and refreshes them, so that generators
serve them inline (Envoy never fetches itself, as with istiod's default
PILOT_JWT_ENABLE_REMOTE_JWKS=false). I/O at the edge; translation stays pure.

As istiod's JwksResolver: a new URI is fetched once at once; if that fails it is retried in the
background (7 more tries, 1 s apart). Every URI is refreshed each PILOT_JWT_PUB_KEY_REFRESH_INTERVAL
(20m), with 7 retries; after a failed refresh the next comes in 1 minute, then doubling up to an
hour. A failed refresh keeps the last good keys; a URI never fetched serves a JWKS no token
verifies against (authn.PUBLIC_ONLY_JWKS). Each fetch counts in
pilot_jwks_resolver_network_fetch_{success,fail}_total. HTTPS trusts the system roots and
/cacerts/extra.pem if present, as istiod.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from prometheus_client import Counter

from istiod.model.snapshot import Snapshot
from istiod.sources.istio.security import jwks_error
from istiod.xds.gen.authn import OPENID_DISCOVERY, jwks_source

log = logging.getLogger(__name__)

REFRESH_INTERVAL = 20 * 60.0  # PILOT_JWT_PUB_KEY_REFRESH_INTERVAL's default
REFRESH_INTERVAL_ON_FAILURE = 60.0
REFRESH_INTERVAL_ON_FAILURE_MAX = 60 * 60.0
RETRY_INTERVAL = 1.0
RETRIES_ON_REFRESH = 7
EXTRA_ROOTS = Path("/cacerts/extra.pem")
_MAX_BODY = 1 << 20

FETCH_SUCCESS = Counter("pilot_jwks_resolver_network_fetch_success",
                        "Total number of successfully network fetch by pilot jwks resolver")
FETCH_FAIL = Counter("pilot_jwks_resolver_network_fetch_fail", "Total number of failed network fetch by pilot jwks resolver")


def jwks_uris(snapshot: Snapshot) -> dict[str, float]:
    """The URIs istiod must fetch (rules without inline keys: their jwksUri, else the issuer's
    OpenID discovery document), with the longest timeout asked."""
    uris: dict[str, float] = {}
    for policy in snapshot.config.request_authentications:
        for rule in policy.jwt_rules:
            if not rule.jwks:
                uri = jwks_source(rule)
                uris[uri] = max(rule.timeout, uris.get(uri, 0.0))
    return uris


class FetchError(Exception):
    pass


def _context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    if EXTRA_ROOTS.is_file():
        context.load_verify_locations(cafile=str(EXTRA_ROOTS))
    return context


def fetch(uri: str, timeout: float, context: ssl.SSLContext | None = None) -> str:
    """A JWKS (blocking: run it in a thread), through the OpenID discovery document when `uri` is
    one; FetchError says why it failed."""
    if uri.endswith(OPENID_DISCOVERY):
        try:
            uri = json.loads(_get(uri, timeout, context))["jwks_uri"]
        except (ValueError, KeyError, TypeError):
            raise FetchError("the OpenID discovery document has no jwks_uri") from None
        if not isinstance(uri, str) or not uri.startswith(("https://", "http://")):
            raise FetchError(f"the OpenID discovery document's jwks_uri {uri!r} is not an http(s) URL")
    text = _get(uri, timeout, context)
    if (problem := jwks_error(text)) is not None:
        raise FetchError(f"not a JSON Web Key Set Envoy accepts: {problem}")
    return text


def _get(uri: str, timeout: float, context: ssl.SSLContext | None) -> str:
    try:
        with urllib.request.urlopen(uri, timeout=timeout, context=context) as response:  # noqa: S310 (http/https only)
            body = response.read(_MAX_BODY + 1)
    except urllib.error.HTTPError as error:
        raise FetchError(f"status {error.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = error.reason if isinstance(error, urllib.error.URLError) else error
        raise FetchError(str(reason)) from None
    if len(body) > _MAX_BODY:
        raise FetchError(f"larger than {_MAX_BODY} bytes")
    return body.decode("utf-8", errors="replace")


KeysListener = Callable[[Mapping[str, str]], None]


class JwksResolver:
    """Call `want(snapshot)` after each push and run `run()`; `on_change` gets every URI's keys
    whenever some changed (then a push serves them)."""

    def __init__(self, on_change: KeysListener, refresh_interval: float = REFRESH_INTERVAL,
                 retry_interval: float = RETRY_INTERVAL, fetcher: Callable[[str, float], str] | None = None) -> None:
        self.on_change = on_change
        self.refresh_interval = refresh_interval
        self.retry_interval = retry_interval
        self.keys: dict[str, str] = {}
        self._wanted: dict[str, float] = {}
        self._new: set[str] = set()
        self._wake = asyncio.Event()
        context = _context()
        self._fetch = fetcher or (lambda uri, timeout: fetch(uri, timeout, context))

    def want(self, snapshot: Snapshot) -> None:
        wanted = jwks_uris(snapshot)
        for uri in self._wanted.keys() - wanted.keys():  # nobody asks any more (istiod evicts after 7 days unused)
            self.keys.pop(uri, None)
        self._new |= wanted.keys() - self._wanted.keys()
        self._wanted = wanted
        if self._new:
            self._wake.set()

    async def _get(self, uri: str, retries: int) -> str | None:
        """The keys, or None after `retries` more tries failed (each counted, the last logged)."""
        for attempt in range(retries + 1):
            if uri not in self._wanted:
                return None
            try:
                keys = await asyncio.to_thread(self._fetch, uri, self._wanted[uri])
            except FetchError as error:
                FETCH_FAIL.inc()
                if attempt == retries:
                    log.warning("failed to fetch JWKS from %s: %s; tokens it would verify are refused until a fetch "
                                "succeeds", uri, error)
                    return None
                await asyncio.sleep(self.retry_interval)
                continue
            FETCH_SUCCESS.inc()
            return keys
        return None

    async def _fetch_all(self, uris: list[str], retries: int) -> bool:
        """Fetch `uris` at once; True if all succeeded. Pushes new keys."""
        results = await asyncio.gather(*(self._get(uri, retries) for uri in uris))
        changed = False
        for uri, keys in zip(uris, results):
            if keys is not None and uri in self._wanted and self.keys.get(uri) != keys:
                if uri in self.keys:
                    log.info("updated cached JWKS from %s", uri)
                self.keys[uri] = keys
                changed = True
        if changed:
            self.on_change(dict(self.keys))
        return all(keys is not None for keys in results)

    async def run(self) -> None:
        interval = self.refresh_interval
        failed_before = False
        loop = asyncio.get_running_loop()
        due = loop.time() + interval
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, due - loop.time()))
            except TimeoutError:
                pass
            if self._new:  # new URIs: one try now, then istiod's background retries for those that failed
                self._wake.clear()
                new, self._new = sorted(self._new), set()
                await self._fetch_all(new, retries=0)
                missing = [uri for uri in new if uri not in self.keys]
                if missing:
                    await asyncio.sleep(self.retry_interval)
                    await self._fetch_all(missing, retries=RETRIES_ON_REFRESH)
                continue
            if loop.time() < due:
                continue
            ok = await self._fetch_all(sorted(self._wanted), retries=RETRIES_ON_REFRESH)
            if ok:
                interval = self.refresh_interval
            elif failed_before:
                interval = min(interval * 2, REFRESH_INTERVAL_ON_FAILURE_MAX)
            else:
                interval = REFRESH_INTERVAL_ON_FAILURE
            failed_before = not ok
            due = loop.time() + interval

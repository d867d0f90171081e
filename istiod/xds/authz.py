"""Who may connect as which proxy on istiod's secure port (Istio's checkConnectionIdentity).

On TLS connections the caller is authenticated like the CA does it (client certificate, token) and
one of its SPIFFE identities must name the namespace, and the service account if the node metadata
gives one, of the proxy it claims to be. The plaintext port is not checked, as in istiod.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc

from istiod.ca.authenticate import AuthenticationError, Authenticator, Credentials, authenticate
from istiod.model.names import parse_spiffe_identity
from istiod.model.proxy import Proxy

log = logging.getLogger(__name__)


def matched_service_account(proxy: Proxy, identities: Sequence[str]) -> str | None:
    """The service account of the first identity that may act as the proxy, else None."""
    for identity in identities:
        parsed = parse_spiffe_identity(identity)
        if parsed is None:
            continue
        _, namespace, service_account = parsed
        if proxy.namespace and namespace != proxy.namespace:
            continue
        if proxy.service_account and service_account != proxy.service_account:
            continue
        return service_account
    return None


def identity_mismatch(proxy: Proxy, identities: Sequence[str]) -> str | None:
    """None if an identity may act as the proxy, else why not."""
    if matched_service_account(proxy, identities) is not None:
        return None
    return f"no identities ([{' '.join(identities)}]) matched {proxy.namespace}/{proxy.service_account}"


class XdsAuthorizer:
    def __init__(self, authenticators: Sequence[Authenticator],
                 credentials_of: Callable[[grpc.aio.ServicerContext], Credentials]) -> None:
        self.authenticators = authenticators
        self.credentials_of = credentials_of

    async def __call__(self, proxy: Proxy, context: grpc.aio.ServicerContext, peer: str) -> str:
        """Abort the stream unless the caller (at `peer`, for the log) proves it may be `proxy`; the
        service account it proved."""
        try:
            caller = await authenticate(self.authenticators, self.credentials_of(context))
        except AuthenticationError as error:
            log.warning("ads: failed to authenticate %s (%s): %s", proxy.id, peer, error.detail)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"authentication failure: {error}")
        service_account = matched_service_account(proxy, caller.identities)
        if service_account is None:
            mismatch = identity_mismatch(proxy, caller.identities)
            log.warning("ads: unauthorized %s (%s): %s", proxy.id, peer, mismatch)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"authorization failed: {mismatch}")
        return service_account  # type: ignore[return-value]  # abort raised otherwise

"""Who may read /debug: callers on loopback; others with a bearer token, as istiod does.

A token is accepted when it equals the one in --debug-auth-token-file, or when the CA's
authenticators accept it (a Kubernetes service-account token via TokenReview, or in config-dir
mode the static-token stand-in) for an identity in istiod's own namespace — istiod's rule for
debug callers. The debug ports are plain HTTP, so a client certificate cannot be presented there.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from istiod.ca.authenticate import AuthenticationError, Authenticator, Credentials, authenticate, bearer_token
from istiod.model.names import parse_spiffe_identity


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    token: str | None = field(default=None, repr=False)  # repr=False: never printed or logged
    authenticators: Sequence[Authenticator] = ()
    namespace: str = "istio-system"

    @classmethod
    def from_token_file(cls, path: Path | None, authenticators: Sequence[Authenticator] = (),
                        namespace: str = "istio-system") -> AccessPolicy:
        if path is None:
            return cls(None, tuple(authenticators), namespace)
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"debug auth token file {path} is empty")
        return cls(token, tuple(authenticators), namespace)

    async def refusal(self, client_host: str | None, authorization: str | None) -> str | None:
        """None when the caller may read debug endpoints, else the reason it may not."""
        if is_loopback(client_host):
            return None
        if self.token is None and not self.authenticators:
            return "debug endpoints are served to loopback callers only (no --debug-auth-token-file is set)"
        credentials = Credentials(authorization=authorization)
        try:
            token = bearer_token(credentials)
        except AuthenticationError:
            return "a caller outside loopback must present 'Authorization: Bearer <token>'"
        if self.token is not None and hmac.compare_digest(token.encode(), self.token.encode()):
            return None
        if not self.authenticators:
            return "the bearer token is not valid"
        try:
            caller = await authenticate(self.authenticators, credentials)
        except AuthenticationError as error:
            return f"the bearer token is not valid: {error}"
        namespaces = {parsed[1] for parsed in map(parse_spiffe_identity, caller.identities) if parsed}
        if self.namespace in namespaces:
            return None
        return f"debug endpoints need an identity in namespace {self.namespace!r}; the token is for {sorted(namespaces)}"


def is_loopback(host: str | None) -> bool:
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    # Python 3.11 does not count ::ffff:127.0.0.1 as loopback; a dual-stack socket reports that form.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback

"""Who may read /debug: callers on loopback, and others only with the configured bearer token.

Istio lets localhost through and authenticates everyone else; until our CA issues client
certificates, a bearer token from a file is the only credential. The check is one pure function so
the CA can add client-certificate checks to it.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    token: str | None = field(default=None, repr=False)  # repr=False: never printed or logged

    @classmethod
    def from_token_file(cls, path: Path | None) -> AccessPolicy:
        if path is None:
            return cls()
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"debug auth token file {path} is empty")
        return cls(token)

    def refusal(self, client_host: str | None, authorization: str | None) -> str | None:
        """None when the caller may read debug endpoints, else the reason it may not."""
        if is_loopback(client_host):
            return None
        if self.token is None:
            return "debug endpoints are served to loopback callers only (no --debug-auth-token-file is set)"
        scheme, _, credential = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not credential:
            return "a caller outside loopback must present 'Authorization: Bearer <token>'"
        if not hmac.compare_digest(credential.strip().encode(), self.token.encode()):
            return "the bearer token is not valid"
        return None


def is_loopback(host: str | None) -> bool:
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    # Python 3.11 does not count ::ffff:127.0.0.1 as loopback; a dual-stack socket reports that form.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback

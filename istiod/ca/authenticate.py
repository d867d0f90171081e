"""Who is calling: authenticators that turn a caller's credentials into SPIFFE identities.

Like istiod, a request is authenticated by the first authenticator that accepts it: a client
certificate issued by this CA (renewal), then a Kubernetes service-account token (TokenReview), or
in config-dir mode, where no TokenReview can exist, the static token file stand-in. Messages say
what was wrong and never contain a token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cryptography import x509
from kubernetes_asyncio.client import AuthenticationV1Api, V1TokenReview, V1TokenReviewSpec

from istiod.ca.pki import uri_sans
from istiod.model.names import check_account, spiffe_identity
from istiod.sources.kube import API_ERRORS, describe_error

TOKEN_AUDIENCE = "istio-ca"
SERVICE_ACCOUNTS_GROUP = "system:serviceaccounts"
TOKEN_REVIEW_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a caller presented: the `authorization` header and the TLS-verified client certificate."""

    authorization: str | None = None
    peer_cert: x509.Certificate | None = None

    def __repr__(self) -> str:  # never print a token
        return f"Credentials(authorization={'<set>' if self.authorization else None}, peer_cert={self.peer_cert!r})"


@dataclass(frozen=True, slots=True)
class Caller:
    identities: tuple[str, ...]
    authenticator: str


class AuthenticationError(Exception):
    def __init__(self, message: str, no_identity: bool = False) -> None:
        super().__init__(message)
        self.no_identity = no_identity  # the caller was authenticated but carried no usable identity


class Authenticator(Protocol):
    name: str

    async def authenticate(self, credentials: Credentials) -> Caller: ...


async def authenticate(authenticators: Sequence[Authenticator], credentials: Credentials) -> Caller:
    """The first authenticator that accepts the caller wins; otherwise every one's reason, in order."""
    reasons: list[str] = []
    no_identity = False
    for authenticator in authenticators:
        try:
            return await authenticator.authenticate(credentials)
        except AuthenticationError as error:
            reasons.append(f"{authenticator.name}: {error}")
            no_identity = no_identity or error.no_identity
    raise AuthenticationError("; ".join(reasons) or "no authenticator is configured", no_identity)


def bearer_token(credentials: Credentials) -> str:
    if credentials.authorization is None:
        raise AuthenticationError("target JWT extraction error: no HTTP authorization header exists")
    scheme, _, token = credentials.authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("target JWT extraction error: no bearer token exists in HTTP authorization header")
    return token.strip()


class ClientCertAuthenticator:
    """Renewal: a client certificate this CA issued (the TLS listener verified it against our roots)."""

    name = "ClientCertAuthenticator"

    async def authenticate(self, credentials: Credentials) -> Caller:
        if credentials.peer_cert is None:
            raise AuthenticationError("no client certificate is presented")
        identities = tuple(uri for uri in uri_sans(credentials.peer_cert) if uri.startswith("spiffe://"))
        if not identities:
            raise AuthenticationError("the client certificate has no SPIFFE URI SAN", no_identity=True)
        return Caller(identities, self.name)


class StaticTokenAuthenticator:
    """A STAND-IN for TokenReview, for config-dir mode where no kube-apiserver exists.

    The file is JSON mapping each token to `namespace/serviceaccount`. Tokens are kept only as
    SHA-256 digests, so neither lookups nor errors can reveal them.
    """

    name = "StaticTokenAuthenticator"

    def __init__(self, accounts: Mapping[str, tuple[str, str]], trust_domain: str) -> None:
        self._accounts = {_digest(token): account for token, account in accounts.items()}
        self.trust_domain = trust_domain

    @classmethod
    def from_file(cls, path: Path, trust_domain: str) -> StaticTokenAuthenticator:
        try:
            entries = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"static token file {path}: {error}") from None
        if not isinstance(entries, dict):
            raise ValueError(f"static token file {path}: must be a JSON object of token -> 'namespace/serviceaccount'")
        accounts = {}
        for number, (token, account) in enumerate(entries.items(), 1):
            namespace, slash, service_account = str(account).partition("/")
            if not slash:
                raise ValueError(f"static token file {path}: entry #{number} must map to 'namespace/serviceaccount'")
            try:
                check_account(namespace, service_account)
            except ValueError as error:
                raise ValueError(f"static token file {path}: entry #{number}: {error}") from None
            accounts[str(token)] = (namespace, service_account)
        return cls(accounts, trust_domain)

    async def authenticate(self, credentials: Credentials) -> Caller:
        account = self._accounts.get(_digest(bearer_token(credentials)))
        if account is None:
            raise AuthenticationError("the token is not in the static token file")
        return Caller((spiffe_identity(self.trust_domain, *account),), self.name)


class TokenReviewAuthenticator:
    """Kubernetes service-account tokens, checked by the API server's TokenReview (audience istio-ca)."""

    name = "KubeJWTAuthenticator"

    def __init__(self, api: AuthenticationV1Api, trust_domain: str, cluster_id: str = "Kubernetes") -> None:
        self.api = api
        self.trust_domain = trust_domain
        self.cluster_id = cluster_id

    async def authenticate(self, credentials: Credentials) -> Caller:
        review = V1TokenReview(spec=V1TokenReviewSpec(token=bearer_token(credentials), audiences=[TOKEN_AUDIENCE]))
        failed = f"failed to validate the JWT from cluster {self.cluster_id!r}"
        try:
            result = await self.api.create_token_review(review, _request_timeout=TOKEN_REVIEW_TIMEOUT)
            namespace, service_account = token_review_account(result.status)
        except API_ERRORS as error:
            raise AuthenticationError(f"{failed}: TokenReview failed: {describe_error(error)}") from None
        except ValueError as error:
            raise AuthenticationError(f"{failed}: {error}") from None
        return Caller((spiffe_identity(self.trust_domain, namespace, service_account),), self.name)


def token_review_account(status: Any) -> tuple[str, str]:
    """(namespace, service account) from a TokenReview's status, with istiod's error messages."""
    if status is None:
        raise ValueError("the TokenReview has no status")
    if status.error:
        raise ValueError(f"the service account authentication returns an error: {status.error}")
    if not status.authenticated:
        raise ValueError("the token is not authenticated")
    user = status.user
    if user is None or SERVICE_ACCOUNTS_GROUP not in (user.groups or []):
        raise ValueError("the token is not a service account")
    return service_account_of(user.username or "")


def service_account_of(username: str) -> tuple[str, str]:
    """`system:serviceaccount:<namespace>:<name>` -> (namespace, name)."""
    parts = username.split(":")
    if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"]:
        raise ValueError("invalid username field in the token review result")
    try:
        check_account(parts[2], parts[3])
    except ValueError as error:
        raise ValueError(f"invalid username field in the token review result: {error}") from None
    return parts[2], parts[3]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()

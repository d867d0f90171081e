"""Who is calling: authenticators that turn a caller's credentials into SPIFFE identities.

Like istiod, a request is authenticated by the first authenticator that accepts it: a client
certificate issued by this CA (renewal), then a Kubernetes service-account token (TokenReview), or
in config-dir mode, where no TokenReview can exist, the static token file stand-in. Messages say
what was wrong and never contain a token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cryptography import x509

from istiod.ca.pki import uri_sans
from istiod.model.mesh import MeshConfig
from istiod.model.names import check_account, parse_account, parse_spiffe_identity, spiffe_identity

# The Kubernetes client (50 MB) only where a TokenReview is made: the xDS workers read certificates
# with this module and never load it.
if TYPE_CHECKING:
    from kubernetes_asyncio.client import AuthenticationV1Api

TOKEN_AUDIENCE = "istio-ca"
SERVICE_ACCOUNTS_GROUP = "system:serviceaccounts"
TOKEN_REVIEW_TIMEOUT = 10.0
CERTIFICATE, TOKEN = "certificate", "token"  # what an authenticator reads of the caller's credentials
NO_CREDENTIALS = "no client certificate or bearer token is presented"


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a caller presented: the `authorization` header and the TLS-verified client certificate."""

    authorization: str | None = None
    peer_cert: x509.Certificate | None = None

    def presents(self, credential: str) -> bool:
        return (self.peer_cert if credential == CERTIFICATE else self.authorization) is not None

    def __repr__(self) -> str:  # never print a token
        return f"Credentials(authorization={'<set>' if self.authorization else None}, peer_cert={self.peer_cert!r})"


@dataclass(frozen=True, slots=True)
class BoundPod:
    """The pod a service-account token is bound to (TokenRequest with a Pod boundObjectRef), as
    TokenReview's user.extra names it; `node` only from Kubernetes versions that add the node too."""

    name: str
    uid: str = ""
    node: str = ""


@dataclass(frozen=True, slots=True)
class Caller:
    identities: tuple[str, ...]
    authenticator: str
    # Istio's KubernetesInfo, for a token's caller only: its (namespace, service account) and bound pod.
    account: tuple[str, str] | None = None
    pod: BoundPod | None = None


class AuthenticationError(Exception):
    """str(): what the caller is told; `detail`: what istiod logs (every authenticator's reason)."""

    def __init__(self, message: str, no_identity: bool = False, detail: str | None = None) -> None:
        super().__init__(message)
        self.no_identity = no_identity  # the caller was authenticated but carried no usable identity
        self.detail = detail or message


class Authenticator(Protocol):
    name: str
    credential: str  # what it reads: CERTIFICATE or TOKEN

    async def authenticate(self, credentials: Credentials) -> Caller: ...


async def authenticate(authenticators: Sequence[Authenticator], credentials: Credentials) -> Caller:
    """The first authenticator that accepts the caller wins. Otherwise the caller is told why each
    authenticator of what it presented (a certificate, a token) refused it, and the log has every one's."""
    reasons: list[str] = []
    told: list[str] = []
    no_identity = False
    for authenticator in authenticators:
        try:
            return await authenticator.authenticate(credentials)
        except AuthenticationError as error:
            reasons.append(f"{authenticator.name}: {error}")
            if credentials.presents(authenticator.credential):
                told.append(reasons[-1])
            no_identity = no_identity or error.no_identity
    if not authenticators:
        raise AuthenticationError("no authenticator is configured")
    raise AuthenticationError("; ".join(told) or NO_CREDENTIALS, no_identity, "; ".join(reasons))


def bearer_token(credentials: Credentials) -> str:
    if credentials.authorization is None:
        raise AuthenticationError("target JWT extraction error: no HTTP authorization header exists")
    scheme, _, token = credentials.authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("target JWT extraction error: no bearer token exists in HTTP authorization header")
    return token.strip()


class ClientCertAuthenticator:
    """Renewal and xDS: a client certificate this CA issued (the TLS listener verified it against our
    roots) naming exactly one SPIFFE identity, in the mesh's trust domain or one of its aliases."""

    name = "ClientCertAuthenticator"
    credential = CERTIFICATE

    def __init__(self, mesh: Callable[[], MeshConfig]) -> None:
        self.mesh = mesh  # the mesh config in force: its trust domain can change without a restart

    async def authenticate(self, credentials: Credentials) -> Caller:
        if credentials.peer_cert is None:
            raise AuthenticationError("no client certificate is presented")
        uris = uri_sans(credentials.peer_cert)
        if not any(uri.startswith("spiffe://") for uri in uris):
            raise AuthenticationError("the client certificate has no SPIFFE URI SAN", no_identity=True)
        if len(uris) > 1:
            raise AuthenticationError(f"the client certificate has {len(uris)} URI SANs; exactly one SPIFFE identity "
                                      "is accepted", no_identity=True)
        parsed = parse_spiffe_identity(uris[0])
        if parsed is None:
            raise AuthenticationError("the client certificate's URI SAN is not "
                                      "spiffe://<trust domain>/ns/<namespace>/sa/<service account>", no_identity=True)
        mesh = self.mesh()
        if parsed[0] not in (mesh.trust_domain, *mesh.trust_domain_aliases):
            aliases = f" or its aliases {', '.join(mesh.trust_domain_aliases)}" if mesh.trust_domain_aliases else ""
            raise AuthenticationError(f"the client certificate's trust domain {parsed[0]!r} is not the mesh's "
                                      f"{mesh.trust_domain!r}{aliases}", no_identity=True)
        return Caller((uris[0],), self.name)


@dataclass(frozen=True, slots=True)
class StaticToken:
    """What the static token file says a token is: an account, and the pod it is bound to, if any."""

    namespace: str
    service_account: str
    pod: BoundPod | None = None


class StaticTokenAuthenticator:
    """A STAND-IN for TokenReview, for config-dir mode where no kube-apiserver exists.

    The file is JSON mapping each token to `namespace/serviceaccount`, or, for a token bound to a pod
    (a node agent's), to `{"serviceAccount": "namespace/serviceaccount", "pod": name, "podUID": uid,
    "node": node name}` (podUID and node optional, as TokenReview's user.extra has them). Tokens are
    kept only as SHA-256 digests, so neither lookups nor errors can reveal them.
    """

    name = "StaticTokenAuthenticator"
    credential = TOKEN

    def __init__(self, tokens: Mapping[str, StaticToken], trust_domain: str) -> None:
        self._tokens = {_digest(token): entry for token, entry in tokens.items()}
        self.trust_domain = trust_domain

    @classmethod
    def from_file(cls, path: Path, trust_domain: str) -> StaticTokenAuthenticator:
        try:
            entries = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"static token file {path}: {error}") from None
        if not isinstance(entries, dict):
            raise ValueError(f"static token file {path}: must be a JSON object of token -> 'namespace/serviceaccount'")
        tokens = {}
        for number, (token, entry) in enumerate(entries.items(), 1):
            try:
                tokens[str(token)] = _static_token(entry)
            except ValueError as error:
                raise ValueError(f"static token file {path}: entry #{number}: {error}") from None
        return cls(tokens, trust_domain)

    async def authenticate(self, credentials: Credentials) -> Caller:
        entry = self._tokens.get(_digest(bearer_token(credentials)))
        if entry is None:
            raise AuthenticationError("the token is not in the static token file")
        account = (entry.namespace, entry.service_account)
        return Caller((spiffe_identity(self.trust_domain, *account),), self.name, account, entry.pod)


_BOUND_FIELDS = {"serviceAccount", "pod", "podUID", "node"}


def _static_token(entry: object) -> StaticToken:
    """One value of the static token file; ValueError says what is wrong (never quoting the token)."""
    pod = None
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - _BOUND_FIELDS)
        if unknown:
            raise ValueError(f"unknown fields {', '.join(unknown)} (known: {', '.join(sorted(_BOUND_FIELDS))})")
        if not all(isinstance(value, str) for value in entry.values()):
            raise ValueError("every field must be a string")
        if entry.get("pod"):
            pod = BoundPod(entry["pod"], entry.get("podUID", ""), entry.get("node", ""))
        elif entry.get("podUID") or entry.get("node"):
            raise ValueError("podUID and node need pod")
        entry = entry.get("serviceAccount", "")
    if not isinstance(entry, str) or "/" not in entry:
        raise ValueError("must map to 'namespace/serviceaccount' or {\"serviceAccount\": ..., \"pod\": ...}")
    return StaticToken(*parse_account(entry), pod)


class TokenReviewAuthenticator:
    """Kubernetes service-account tokens, checked by the API server's TokenReview (audience istio-ca)."""

    name = "KubeJWTAuthenticator"
    credential = TOKEN

    def __init__(self, api: AuthenticationV1Api, trust_domain: str, cluster_id: str = "Kubernetes") -> None:
        self.api = api
        self.trust_domain = trust_domain
        self.cluster_id = cluster_id

    async def authenticate(self, credentials: Credentials) -> Caller:
        from kubernetes_asyncio.client import V1TokenReview, V1TokenReviewSpec

        from istiod.sources.kube import API_ERRORS, describe_error

        review = V1TokenReview(spec=V1TokenReviewSpec(token=bearer_token(credentials), audiences=[TOKEN_AUDIENCE]))
        failed = f"failed to validate the JWT from cluster {self.cluster_id!r}"
        try:
            result = await self.api.create_token_review(review, _request_timeout=TOKEN_REVIEW_TIMEOUT)
            account = token_review_account(result.status)
        except API_ERRORS as error:
            raise AuthenticationError(f"{failed}: TokenReview failed: {describe_error(error)}") from None
        except ValueError as error:
            raise AuthenticationError(f"{failed}: {error}") from None
        return Caller((spiffe_identity(self.trust_domain, *account),), self.name, account,
                      bound_pod(result.status.user.extra))


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


POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def bound_pod(extra: Mapping[str, Sequence[str]] | None) -> BoundPod | None:
    """The pod a reviewed token is bound to, from TokenReview's user.extra (one value per key)."""
    def one(key: str) -> str:
        values = (extra or {}).get(key) or []
        return values[0] if len(values) == 1 and isinstance(values[0], str) else ""

    name = one(POD_NAME_EXTRA)
    return BoundPod(name, one(POD_UID_EXTRA), one(NODE_NAME_EXTRA)) if name else None


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

"""The secure port (15012) as the xDS workers serve it, and what they ask the main process for.

Each worker runs a TLS front of its own (istiod/tlsfront.py) in the port's SO_REUSEPORT group, so the
kernel spreads new TLS connections among the workers as it does 15010's, and relays them to a gRPC
server of its own on loopback that serves ADS and the CA. TLS and the relay thus cost each worker
its share of the connections instead of all of them costing the main process.

The worker checks a client certificate itself (the TLS handshake verified it against the roots; the
trust domain comes with each push's mesh config). What needs the CA's key or the Kubernetes client
stays in the main process: a CSR (`Sign`) and a token's check (`Authenticate`) go to it over the
worker's pipes and come back as the certificate chain or the refusal its caller gets.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from istiod.ca.authenticate import (
    TOKEN, AuthenticationError, Authenticator, Caller, ClientCertAuthenticator, Credentials, authenticate,
)
from istiod.ca.service import Refusal
from istiod.ca.serving import ServingPem, server_context
from istiod.gen.istio.v1.auth import ca_pb2
from istiod.keepalive import Keepalive
from istiod.model.mesh import MeshConfig
from istiod.tlsfront import TlsFront
from istiod.xds import admission
from istiod.xds.authz import XdsAuthorizer
from istiod.xds.server import DiscoveryServer, add_to_server

CA_SERVICE = "istio.v1.auth.IstioCertificateService"


@dataclass(frozen=True, slots=True)
class Presented:
    """A caller's credentials as they cross the pipe (the certificate as DER)."""

    authorization: str | None
    peer_cert: bytes | None
    peer: str

    @staticmethod
    def of(credentials: Credentials, peer: str) -> Presented:
        cert = credentials.peer_cert
        return Presented(credentials.authorization, cert.public_bytes(Encoding.DER) if cert else None, peer)

    def credentials(self) -> Credentials:
        cert = x509.load_der_x509_certificate(self.peer_cert) if self.peer_cert else None
        return Credentials(self.authorization, cert)

    def __repr__(self) -> str:  # never print a token
        return f"Presented(authorization={'<set>' if self.authorization else None}, peer={self.peer!r})"


# From a worker to the main process, answered by a Refused or the value each names.
@dataclass(frozen=True, slots=True)
class Sign:
    """A CreateCertificate call: the serialized request; answered with the serialized response."""

    request: bytes
    presented: Presented


@dataclass(frozen=True, slots=True)
class Authenticate:
    """An xDS caller's token, for the main process's token authenticators; answered with a Caller."""

    presented: Presented


@dataclass(frozen=True, slots=True)
class Refused:
    """What the caller is told (a gRPC status), or, for Authenticate, the AuthenticationError's parts."""

    code: str  # a grpc.StatusCode's name
    message: str
    detail: str = ""
    no_identity: bool = False


@dataclass(frozen=True, slots=True)
class SecureStart:
    """What a worker needs to serve the secure port: its address, the name of the main process's token
    authenticator if it has one, and the serving certificate (a later one comes as a ServingPem)."""

    host: str
    port: int
    token_authenticator: str | None
    pem: ServingPem


# How a worker asks the main process, and how the main process answers.
SecureAnswer = Callable[[Sign | Authenticate], Awaitable[Any]]


class RemoteTokenAuthenticator:
    """The main process's token authenticator (TokenReview, or the static tokens), asked over the pipe."""

    credential = TOKEN

    def __init__(self, name: str, ask: SecureAnswer) -> None:
        self.name = name
        self.ask = ask

    async def authenticate(self, credentials: Credentials) -> Caller:
        answer = await self.ask(Authenticate(Presented(credentials.authorization, None, "")))
        if isinstance(answer, Refused):
            raise AuthenticationError(answer.message, answer.no_identity, answer.detail or None)
        assert isinstance(answer, Caller)
        return answer


class SecureServing:
    """A worker's share of the secure port: its TLS front and the loopback gRPC server behind it."""

    def __init__(self, start: SecureStart, ads: DiscoveryServer, mesh: Callable[[], MeshConfig], ask: SecureAnswer,
                 keepalive: Keepalive, max_connections: int) -> None:
        self.pem = start.pem
        self._context = server_context(start.pem, ("h2",))
        self.ask = ask
        self.inner = grpc.aio.server(options=[*admission.CORE_OPTIONS, ("grpc.so_reuseport", 0),
                                              *keepalive.server_options()])
        backend_port = self.inner.add_insecure_port("127.0.0.1:0")
        self.front = TlsFront(start.host, start.port, backend_port, lambda: self._context, keepalive.timeout,
                              max_connections, reuse_port=True)
        authenticators: list[Authenticator] = [ClientCertAuthenticator(mesh)]
        if start.token_authenticator is not None:
            authenticators.append(RemoteTokenAuthenticator(start.token_authenticator, ask))
        add_to_server(ads.authorized(XdsAuthorizer(authenticators, self.front.credentials), self.front.client),
                      self.inner)
        handlers: dict[str, grpc.RpcMethodHandler] = {
            "CreateCertificate": grpc.unary_unary_rpc_method_handler(self._create_certificate)}
        self.inner.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(CA_SERVICE, handlers),))
        self.inner.add_registered_method_handlers(CA_SERVICE, handlers)

    def install(self, pem: ServingPem) -> None:
        """A renewed serving certificate (or new roots), for the connections accepted from now on."""
        self.pem, self._context = pem, server_context(pem, ("h2",))

    async def start(self) -> None:
        await self.inner.start()
        await self.front.start()

    async def stop(self, grace: float) -> None:
        self.front.stop_accepting()
        await self.inner.stop(grace=grace)
        await self.front.stop()

    async def _create_certificate(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """The request and response pass as bytes: the main process parses and signs."""
        answer = await self.ask(Sign(raw, Presented.of(self.front.credentials(context), self.front.client(context))))
        if isinstance(answer, Refused):
            await context.abort(grpc.StatusCode[answer.code], answer.message)
        assert isinstance(answer, bytes)
        return answer


async def answer(question: Sign | Authenticate,
                 sign: Callable[[bytes, Credentials, str], Awaitable[ca_pb2.IstioCertificateResponse]],
                 token_authenticators: list[Authenticator]) -> Any:
    """The main process's answer to a worker's question."""
    if isinstance(question, Sign):
        try:
            signed = await sign(question.request, question.presented.credentials(), question.presented.peer)
            return signed.SerializeToString()
        except Refusal as refusal:
            return Refused(refusal.code.name, refusal.message)
    try:
        return await authenticate(token_authenticators, question.presented.credentials())
    except AuthenticationError as error:
        return Refused(grpc.StatusCode.UNAUTHENTICATED.name, str(error), error.detail, error.no_identity)


"""The grpc.aio IstioCertificateService: authenticate the caller, sign its CSR, count everything."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

import grpc
from google.protobuf.message import DecodeError

from istiod import logs, metrics
from istiod.ca.authenticate import AuthenticationError, Authenticator, Credentials, authenticate
from istiod.ca.nodeauth import IMPERSONATED_IDENTITY, ImpersonationDenied, NodeAuthorizer
from istiod.ca.root import CertificateAuthority
from istiod.ca.signer import SignError, SignErrorKind, TtlPolicy, sign_csr
from istiod.gen.istio.v1.auth import ca_pb2, ca_pb2_grpc

log = logging.getLogger(__name__)
_malformed = logs.Throttled(log)  # a client can send these as fast as it likes
SERVICE = "istio.v1.auth.IstioCertificateService"

_STATUS = {
    SignErrorKind.CSR: grpc.StatusCode.INVALID_ARGUMENT,
    SignErrorKind.TTL: grpc.StatusCode.INVALID_ARGUMENT,
    SignErrorKind.CERT_GEN: grpc.StatusCode.INTERNAL,
}


class Refusal(Exception):
    """A request refused, with the gRPC status its caller gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class CertificateService(ca_pb2_grpc.IstioCertificateServiceServicer):
    def __init__(
        self,
        ca: CertificateAuthority,
        policy: TtlPolicy,
        authenticators: Sequence[Authenticator],
        nodes: NodeAuthorizer,
        credentials_of: Callable[[grpc.aio.ServicerContext], Credentials] | None = None,
        peer_of: Callable[[grpc.aio.ServicerContext], str] | None = None,
    ) -> None:
        """`credentials_of`: a gRPC call's credentials, when this serves calls itself (not when it signs
        for the xDS workers' calls, which come with theirs); `peer_of`: its caller's address, for the log,
        where gRPC sees another (behind the TLS front)."""
        self.ca = ca
        self.policy = policy
        self.authenticators = authenticators
        self.credentials_of = credentials_of
        self.peer_of = peer_of or (lambda context: context.peer())
        self.nodes = nodes

    async def CreateCertificate(
        self, request: ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext
    ) -> ca_pb2.IstioCertificateResponse:
        assert self.credentials_of is not None
        try:
            return await self.sign(request, self.credentials_of(context), self.peer_of(context))
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.message)
            raise  # abort raises; for the type checker

    async def create_from_bytes(self, raw: bytes, context: grpc.aio.ServicerContext) -> ca_pb2.IstioCertificateResponse:
        assert self.credentials_of is not None
        try:
            return await self.sign_bytes(raw, self.credentials_of(context), self.peer_of(context))
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.message)
            raise

    async def sign_bytes(self, raw: bytes, credentials: Credentials, peer: str) -> ca_pb2.IstioCertificateResponse:
        """The request parsed here rather than by gRPC, whose failure would log a traceback per message:
        garbage (before any authentication) is one throttled line and INVALID_ARGUMENT, as on the ADS path."""
        try:
            request = ca_pb2.IstioCertificateRequest.FromString(raw)
        except DecodeError as error:
            _malformed.warning(logs.event("CA: malformed certificate request", client=peer, error=str(error)))
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"malformed IstioCertificateRequest: {error}") from None
        return await self.sign(request, credentials, peer)

    async def sign(self, request: ca_pb2.IstioCertificateRequest, credentials: Credentials,
                   peer: str) -> ca_pb2.IstioCertificateResponse:
        """The caller (`peer`, for the log) authenticated by `credentials`, its CSR signed; Refusal otherwise."""
        metrics.CSR_COUNT.inc()
        try:
            caller = await authenticate(self.authenticators, credentials)
        except AuthenticationError as error:
            metrics.AUTHENTICATION_FAILURE_COUNT.inc()
            if error.no_identity:
                metrics.ID_EXTRACTION_ERR_COUNT.inc()
            log.warning("CA: authentication failed for %s: %s", peer, error.detail)
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, f"request authenticate failure: {error}") from None
        identities = caller.identities
        impersonated = request.metadata.fields.get(IMPERSONATED_IDENTITY)
        if impersonated is not None:
            if impersonated.WhichOneof("kind") != "string_value":
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"metadata {IMPERSONATED_IDENTITY} must be a string")
            try:
                identities = (self.nodes.authorize(caller, impersonated.string_value),)
            except ImpersonationDenied as error:
                metrics.AUTHENTICATION_FAILURE_COUNT.inc()
                log.warning("CA: impersonation denied for %s (%s): %s", ",".join(caller.identities), peer, error)
                raise Refusal(grpc.StatusCode.PERMISSION_DENIED, f"impersonation denied: {error}") from None
        bundle = self.ca.bundle
        try:
            chain = sign_csr(bundle, request.csr, identities, request.validity_duration, self.policy,
                             datetime.now(timezone.utc))
        except SignError as error:
            if error.kind is SignErrorKind.CSR:
                metrics.CSR_PARSING_ERR_COUNT.inc()
            metrics.CSR_SIGN_ERR_COUNT.labels(error.kind.value).inc()
            log.warning("CA: CSR signing error for %s: %s", ",".join(identities), error)
            raise Refusal(_STATUS[error.kind], f"CSR signing error ({error})") from None
        metrics.SUCCESS_CERT_ISSUANCE_COUNT.inc()
        on_behalf = f", on behalf of node account {'/'.join(caller.account or ())}" if impersonated is not None else ""
        log.info("CA: issued a certificate for %s (by %s%s)", ",".join(identities), caller.authenticator, on_behalf)
        return ca_pb2.IstioCertificateResponse(cert_chain=chain)


def add_to_server(service: CertificateService, server: grpc.aio.Server) -> None:
    """As the generated add_IstioCertificateServiceServicer_to_server, but handing requests over as bytes."""
    handlers: dict[str, grpc.RpcMethodHandler] = {"CreateCertificate": grpc.unary_unary_rpc_method_handler(
        service.create_from_bytes, response_serializer=ca_pb2.IstioCertificateResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)

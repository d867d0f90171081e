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


class CertificateService(ca_pb2_grpc.IstioCertificateServiceServicer):
    def __init__(
        self,
        ca: CertificateAuthority,
        policy: TtlPolicy,
        authenticators: Sequence[Authenticator],
        credentials_of: Callable[[grpc.aio.ServicerContext], Credentials],
        nodes: NodeAuthorizer,
    ) -> None:
        self.ca = ca
        self.policy = policy
        self.authenticators = authenticators
        self.credentials_of = credentials_of
        self.nodes = nodes

    async def CreateCertificate(
        self, request: ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext
    ) -> ca_pb2.IstioCertificateResponse:
        metrics.CSR_COUNT.inc()
        try:
            caller = await authenticate(self.authenticators, self.credentials_of(context))
        except AuthenticationError as error:
            metrics.AUTHENTICATION_FAILURE_COUNT.inc()
            if error.no_identity:
                metrics.ID_EXTRACTION_ERR_COUNT.inc()
            log.warning("CA: authentication failed for %s: %s", context.peer(), error.detail)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"request authenticate failure: {error}")
        identities = caller.identities
        impersonated = request.metadata.fields.get(IMPERSONATED_IDENTITY)
        if impersonated is not None:
            if impersonated.WhichOneof("kind") != "string_value":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"metadata {IMPERSONATED_IDENTITY} must be a string")
            try:
                identities = (self.nodes.authorize(caller, impersonated.string_value),)
            except ImpersonationDenied as error:
                metrics.AUTHENTICATION_FAILURE_COUNT.inc()
                log.warning("CA: impersonation denied for %s (%s): %s", ",".join(caller.identities), context.peer(),
                            error)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"impersonation denied: {error}")
        bundle = self.ca.bundle
        try:
            chain = sign_csr(bundle, request.csr, identities, request.validity_duration, self.policy,
                             datetime.now(timezone.utc))
        except SignError as error:
            if error.kind is SignErrorKind.CSR:
                metrics.CSR_PARSING_ERR_COUNT.inc()
            metrics.CSR_SIGN_ERR_COUNT.labels(error.kind.value).inc()
            log.warning("CA: CSR signing error for %s: %s", ",".join(identities), error)
            await context.abort(_STATUS[error.kind], f"CSR signing error ({error})")
        metrics.SUCCESS_CERT_ISSUANCE_COUNT.inc()
        on_behalf = f", on behalf of node account {'/'.join(caller.account or ())}" if impersonated is not None else ""
        log.info("CA: issued a certificate for %s (by %s%s)", ",".join(identities), caller.authenticator, on_behalf)
        return ca_pb2.IstioCertificateResponse(cert_chain=chain)

    async def create_from_bytes(self, raw: bytes, context: grpc.aio.ServicerContext) -> ca_pb2.IstioCertificateResponse:
        """The request parsed here rather than by gRPC, whose failure would log a traceback per message:
        garbage (before any authentication) is one throttled line and INVALID_ARGUMENT, as on the ADS path."""
        try:
            request = ca_pb2.IstioCertificateRequest.FromString(raw)
        except DecodeError as error:
            _malformed.warning(logs.event("CA: malformed certificate request", client=context.peer(), error=str(error)))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed IstioCertificateRequest: {error}")
        return await self.CreateCertificate(request, context)


def add_to_server(service: CertificateService, server: grpc.aio.Server) -> None:
    """As the generated add_IstioCertificateServiceServicer_to_server, but handing requests over as bytes."""
    handlers: dict[str, grpc.RpcMethodHandler] = {"CreateCertificate": grpc.unary_unary_rpc_method_handler(
        service.create_from_bytes, response_serializer=ca_pb2.IstioCertificateResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)

"""The grpc.aio IstioCertificateService: authenticate the caller, sign its CSR, count everything."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

import grpc

from istiod import metrics
from istiod.ca.authenticate import AuthenticationError, Authenticator, Credentials, authenticate
from istiod.ca.root import CertificateAuthority
from istiod.ca.signer import SignError, SignErrorKind, TtlPolicy, sign_csr
from istiod.gen.istio.v1.auth import ca_pb2, ca_pb2_grpc

log = logging.getLogger(__name__)

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
    ) -> None:
        self.ca = ca
        self.policy = policy
        self.authenticators = authenticators
        self.credentials_of = credentials_of

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
            log.warning("CA: authentication failed for %s: %s", context.peer(), error)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"request authenticate failure: {error}")
        bundle = self.ca.bundle
        try:
            chain = sign_csr(bundle, request.csr, caller.identities, request.validity_duration, self.policy,
                             datetime.now(timezone.utc))
        except SignError as error:
            if error.kind is SignErrorKind.CSR:
                metrics.CSR_PARSING_ERR_COUNT.inc()
            metrics.CSR_SIGN_ERR_COUNT.labels(error.kind.value).inc()
            log.warning("CA: CSR signing error for %s: %s", ",".join(caller.identities), error)
            await context.abort(_STATUS[error.kind], f"CSR signing error ({error})")
        metrics.SUCCESS_CERT_ISSUANCE_COUNT.inc()
        log.info("CA: issued a certificate for %s (by %s)", ",".join(caller.identities), caller.authenticator)
        return ca_pb2.IstioCertificateResponse(cert_chain=chain)


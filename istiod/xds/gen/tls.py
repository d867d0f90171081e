"""mTLS transport sockets, as Istio's generators add them. Pure.

Both flavors name the workload's certificate `default` and the mesh root `ROOTCA`. gRPC takes them
only from certificate provider instances named in its bootstrap (the agent writes a file_watcher
called `default`); Envoy asks the agent for them over SDS, through the bootstrap's `sds-grpc`
cluster, as it does with pilot-agent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from envoy.config.core.v3 import base_pb2, config_source_pb2, grpc_service_pb2
from envoy.extensions.transport_sockets.raw_buffer.v3 import raw_buffer_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import any_pb2, duration_pb2, wrappers_pb2

from istiod.certfiles import PROVIDER_INSTANCE
from istiod.model.config.networking import ClientTLS, ServerTLS, ServerTLSMode, TLSMode
from istiod.model.credentials import CA_SUFFIX, file_cert_resource, file_root_resource
from istiod.model.names import spiffe_identity
from istiod.model.service import Endpoint
from istiod.xds.gen.filters import ads_source

TLS_TRANSPORT_SOCKET = "envoy.transport_sockets.tls"
RAW_BUFFER_TRANSPORT_SOCKET = "envoy.transport_sockets.raw_buffer"
IDENTITY_CERTIFICATE = "default"
ROOT_CERTIFICATE = "ROOTCA"
SDS_CLUSTER = "sds-grpc"
# What a sidecar offers in its mTLS handshakes, and what marks a connection as mesh mTLS on the
# inbound side (Istio's ALPNs, so Istio's sidecars and ours recognise each other). Istio's offers
# `istio-peer-exchange` first only with its metadata-exchange filter, which upstream Envoy lacks:
# without it, `istio` alone, as Istio's istiod sends with PILOT_ENABLE_METADATA_EXCHANGE=false.
MESH_ALPN = ("istio",)
MESH_ALPN_MATCH = ("istio", "istio-peer-exchange", "istio-http/1.0", "istio-http/1.1", "istio-h2")
# Istio's inbound catch-all chains: HTTP the client's sidecar detected, sent over mTLS (their ALPN
# says so) or plaintext (the HTTP inspector's); and TCP it could not tell, over mTLS.
MESH_HTTP_ALPN_MATCH = ("istio-http/1.0", "istio-http/1.1", "istio-h2")
PLAINTEXT_HTTP_ALPN_MATCH = ("http/1.1", "h2c")
MESH_TCP_ALPN_MATCH = ("istio-peer-exchange", "istio")
HTTP_ALPN = ("h2", "http/1.1")
# What pilot-agent serves as `file-root:system` when a DestinationRule names no CA: the bundle of
# Istio's proxy image (Debian's path).
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CREDENTIAL_PREFIX = "kubernetes://"  # istiod's name for a credentialName's SDS secret
# Istio's minProtocolVersion/maxProtocolVersion values -> Envoy's.
TLS_VERSIONS = {
    "TLS_AUTO": common_pb2.TlsParameters.TLS_AUTO, "TLSV1_0": common_pb2.TlsParameters.TLSv1_0,
    "TLSV1_1": common_pb2.TlsParameters.TLSv1_1, "TLSV1_2": common_pb2.TlsParameters.TLSv1_2,
    "TLSV1_3": common_pb2.TlsParameters.TLSv1_3,
}


def destination_identities(endpoints: Iterable[Endpoint], trust_domain: str) -> tuple[str, ...]:
    """The SPIFFE IDs a destination may present: its endpoints' service accounts."""
    return tuple(sorted({spiffe_identity(trust_domain, e.namespace, e.service_account or "default") for e in endpoints}))


def upstream_tls(identities: Iterable[str]) -> base_pb2.TransportSocket:
    """Client side: present our certificate, trust the mesh root, accept only the destination's IDs."""
    context = tls_pb2.UpstreamTlsContext(common_tls_context=_common_tls_context(identities))
    return _transport_socket(context)


def downstream_tls() -> base_pb2.TransportSocket:
    """Server side (STRICT): require a client certificate from the mesh."""
    context = tls_pb2.DownstreamTlsContext(
        common_tls_context=_common_tls_context(()), require_client_certificate=wrappers_pb2.BoolValue(value=True)
    )
    return _transport_socket(context)


def _common_tls_context(identities: Iterable[str]) -> tls_pb2.CommonTlsContext:
    return tls_pb2.CommonTlsContext(
        tls_certificate_provider_instance=common_pb2.CertificateProviderPluginInstance(
            instance_name=PROVIDER_INSTANCE, certificate_name=IDENTITY_CERTIFICATE
        ),
        validation_context=common_pb2.CertificateValidationContext(
            ca_certificate_provider_instance=common_pb2.CertificateProviderPluginInstance(
                instance_name=PROVIDER_INSTANCE, certificate_name=ROOT_CERTIFICATE
            ),
            match_subject_alt_names=[string_pb2.StringMatcher(exact=identity) for identity in identities],
        ),
    )


def _transport_socket(context: tls_pb2.UpstreamTlsContext | tls_pb2.DownstreamTlsContext) -> base_pb2.TransportSocket:
    packed = any_pb2.Any()
    packed.Pack(context)
    return base_pb2.TransportSocket(name=TLS_TRANSPORT_SOCKET, typed_config=packed)


def sds_upstream_tls(identities: Iterable[str], sni: str, http2: bool = False) -> base_pb2.TransportSocket:
    """Envoy, client side: our certificate over SDS, the root over SDS, the destination's IDs only;
    an HTTP/2 cluster offers `h2` after `istio`, as istiod's ALPNInMeshH2."""
    context = tls_pb2.UpstreamTlsContext(
        common_tls_context=_sds_tls_context(MESH_ALPN + ("h2",) if http2 else MESH_ALPN, identities), sni=sni
    )
    return _transport_socket(context)


def sds_hbone_upstream_tls() -> base_pb2.TransportSocket:
    """HBONE, client side (a waypoint to a pod's ztunnel): HTTP/2 over mTLS with our certificate over SDS,
    any identity the mesh root signed (ztunnel answers for every pod of its node)."""
    return _transport_socket(tls_pb2.UpstreamTlsContext(common_tls_context=_sds_tls_context(("h2",), ())))


def sds_downstream_tls(alpn: Iterable[str], identities: Iterable[str] = (), crl: str = "") -> base_pb2.TransportSocket:
    """Envoy, server side: require a client certificate the mesh root signed (of `identities`, or
    any mesh identity) and the CRL file `crl` does not revoke."""
    common = _sds_tls_context(alpn, identities)
    if crl:
        common.combined_validation_context.default_validation_context.crl.filename = crl
    context = tls_pb2.DownstreamTlsContext(common_tls_context=common, require_client_certificate=wrappers_pb2.BoolValue(value=True))
    return _transport_socket(context)


def originated_tls(tls: ClientTLS, alpn: Iterable[str], default_sans: Iterable[str] = ()) -> base_pb2.TransportSocket:
    """Envoy, client side, for a DestinationRule's SIMPLE or MUTUAL TLS: the files it names, read
    by Envoy in the sidecar (istiod has the agent serve the same files over SDS). The CA is the
    system's unless named; `insecureSkipVerify` checks nothing; subjectAltNames match a DNS or URI
    SAN, and when the rule names none, `default_sans` do (a ServiceEntry's subjectAltNames, as istiod)."""
    common = tls_pb2.CommonTlsContext(alpn_protocols=list(alpn))
    if tls.credential_name:
        _credential_sds(common, tls, default_sans)
        return _transport_socket(tls_pb2.UpstreamTlsContext(common_tls_context=common, sni=tls.sni))
    if tls.mode is TLSMode.MUTUAL:
        common.tls_certificates.add(certificate_chain=base_pb2.DataSource(filename=tls.client_certificate),
                                    private_key=base_pb2.DataSource(filename=tls.private_key))
    if not tls.insecure_skip_verify:
        validation = common.validation_context
        validation.trusted_ca.filename = tls.ca_certificates or SYSTEM_CA_BUNDLE
        if tls.ca_crl:
            validation.crl.filename = tls.ca_crl  # a server certificate it revokes fails the handshake
        validation.match_typed_subject_alt_names.extend(_san_matchers(tls.subject_alt_names or default_sans))
    return _transport_socket(tls_pb2.UpstreamTlsContext(common_tls_context=common, sni=tls.sni))


def server_tls(tls: ServerTLS, alpn: Sequence[str], credentials: Sequence[str] = (),
               ca_credential: str | None = None) -> tls_pb2.DownstreamTlsContext:
    """A server's own TLS (istiod's BuildListenerTLSContext for SIMPLE, MUTUAL and OPTIONAL_MUTUAL):
    a gateway's certificates are `credentials` over SDS on the ADS stream (Envoy picks the one the
    client's algorithms admit, e.g. RSA or ECDSA), its client CA `ca_credential` combined with the
    settings' SPKI and hash pins (istiod's ApplyCredentialSDSToServerCommonTLSContext); without
    credentials (files in the pod: a gateway's, a Sidecar ingress listener's) the agent's
    `file-cert:` of each certificate and `file-root:` of caCertificates, client SANs the settings'.
    A client certificate is required for MUTUAL, asked for and verified if sent for OPTIONAL_MUTUAL."""
    params = common_pb2.TlsParameters(
        # istiod's defaults for its servers: TLS 1.2 to 1.3 (validation admits only TLS_VERSIONS' names).
        tls_minimum_protocol_version=TLS_VERSIONS[tls.min_protocol_version or "TLSV1_2"],
        tls_maximum_protocol_version=TLS_VERSIONS[tls.max_protocol_version or "TLSV1_3"],
        cipher_suites=list(tls.cipher_suites),
    )
    common = tls_pb2.CommonTlsContext(alpn_protocols=list(alpn), tls_params=params)
    verifies = tls.mode in (ServerTLSMode.MUTUAL, ServerTLSMode.OPTIONAL_MUTUAL)
    if credentials:
        # No fetch timeout: the listener waits for its certificates rather than serving without.
        source = ads_source(initial_fetch_timeout=duration_pb2.Duration())
        for credential in credentials:
            common.tls_certificate_sds_secret_configs.add(name=credential, sds_config=source)
        if ca_credential is not None:
            combined = common.combined_validation_context
            combined.default_validation_context.verify_certificate_spki.extend(tls.verify_certificate_spki)
            combined.default_validation_context.verify_certificate_hash.extend(tls.verify_certificate_hash)
            if tls.insecure_skip_verify:
                combined.default_validation_context.trust_chain_verification = \
                    common_pb2.CertificateValidationContext.ACCEPT_UNTRUSTED
            combined.validation_context_sds_secret_config.CopyFrom(
                secret_pb2.SdsSecretConfig(name=ca_credential, sds_config=source))
    else:
        # Files in the pod, which the agent serves over its SDS and watches (istiod's ApplyToCommonTLSContext):
        # a replaced file is served without a restart, as Envoy reading them itself would not.
        common.tls_certificate_sds_secret_configs.extend(
            _sds_secret(file_cert_resource(certificate, key), waits=False) for certificate, key in tls.certificate_files)
        if verifies:  # validation requires caCertificates for MUTUAL and OPTIONAL_MUTUAL
            combined = common.combined_validation_context
            combined.default_validation_context.match_typed_subject_alt_names.extend(_san_matchers(tls.subject_alt_names))
            if tls.ca_crl:
                combined.default_validation_context.crl.filename = tls.ca_crl  # Envoy reads it, as with istiod
            combined.validation_context_sds_secret_config.CopyFrom(
                _sds_secret(file_root_resource(tls.ca_certificates), waits=False))
    return tls_pb2.DownstreamTlsContext(
        common_tls_context=common, require_client_certificate=wrappers_pb2.BoolValue(value=tls.mode is ServerTLSMode.MUTUAL))


def credential_resource(name: str) -> str:
    """istiod's SDS name for a credentialName: `kubernetes://<name>`, the Secret of the proxy's namespace;
    a name with its own type (`configmap://`, `invalid://`) is kept."""
    return name if "://" in name else CREDENTIAL_PREFIX + name


def _credential_sds(common: tls_pb2.CommonTlsContext, tls: ClientTLS, default_sans: Iterable[str]) -> None:
    """istiod's ApplyCustomSDSToClientCommonTLSContext: the client certificate (MUTUAL) is the Secret's
    `kubernetes://<name>`, the CA (and CRL) its `kubernetes://<name>-cacert`, both over ADS."""
    name = credential_resource(tls.credential_name)
    if tls.mode is TLSMode.MUTUAL:
        common.tls_certificate_sds_secret_configs.add(name=name, sds_config=_ads())
    if tls.insecure_skip_verify:
        return
    combined = common.combined_validation_context
    combined.default_validation_context.match_typed_subject_alt_names.extend(
        _san_matchers(tls.subject_alt_names or default_sans))
    combined.validation_context_sds_secret_config.CopyFrom(
        secret_pb2.SdsSecretConfig(name=name + CA_SUFFIX, sds_config=_ads()))


def _san_matchers(names: Iterable[str]) -> list[common_pb2.SubjectAltNameMatcher]:
    """Each name matched exactly as a DNS or a URI SAN (istiod's untyped exact match)."""
    return [common_pb2.SubjectAltNameMatcher(san_type=san_type, matcher=string_pb2.StringMatcher(exact=name))
            for name in names
            for san_type in (common_pb2.SubjectAltNameMatcher.DNS, common_pb2.SubjectAltNameMatcher.URI)]


def _ads() -> config_source_pb2.ConfigSource:
    # Envoy's default fetch timeout (15 s), as istiod: then the cluster comes up and its handshakes fail.
    return config_source_pb2.ConfigSource(ads=config_source_pb2.AggregatedConfigSource(),
                                          resource_api_version=config_source_pb2.V3)


def raw_buffer() -> base_pb2.TransportSocket:
    packed = any_pb2.Any()
    packed.Pack(raw_buffer_pb2.RawBuffer())
    return base_pb2.TransportSocket(name=RAW_BUFFER_TRANSPORT_SOCKET, typed_config=packed)


def _sds_tls_context(alpn: Iterable[str], identities: Iterable[str]) -> tls_pb2.CommonTlsContext:
    return tls_pb2.CommonTlsContext(
        alpn_protocols=list(alpn),
        tls_params=common_pb2.TlsParameters(
            tls_minimum_protocol_version=common_pb2.TlsParameters.TLSv1_2,
            tls_maximum_protocol_version=common_pb2.TlsParameters.TLSv1_3,
        ),
        tls_certificate_sds_secret_configs=[_sds_secret(IDENTITY_CERTIFICATE)],
        combined_validation_context=tls_pb2.CommonTlsContext.CombinedCertificateValidationContext(
            default_validation_context=common_pb2.CertificateValidationContext(
                match_typed_subject_alt_names=[
                    common_pb2.SubjectAltNameMatcher(
                        san_type=common_pb2.SubjectAltNameMatcher.URI, matcher=string_pb2.StringMatcher(exact=identity)
                    )
                    for identity in identities
                ]
            ),
            validation_context_sds_secret_config=_sds_secret(ROOT_CERTIFICATE),
        ),
    )


def _sds_secret(name: str, waits: bool = True) -> secret_pb2.SdsSecretConfig:
    # `waits`: no fetch timeout, as Istio for the mesh certificate: a listener or cluster waits for it
    # rather than coming up without one. Else Envoy's 15 s, as istiod for files in the pod: a file
    # missing leaves its listener up without a certificate, and the proxy can become ready.
    source = config_source_pb2.ConfigSource(
        api_config_source=config_source_pb2.ApiConfigSource(
            api_type=config_source_pb2.ApiConfigSource.GRPC,
            transport_api_version=config_source_pb2.V3,
            grpc_services=[grpc_service_pb2.GrpcService(
                envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=SDS_CLUSTER))],
            set_node_on_first_message_only=True,
        ),
        initial_fetch_timeout=duration_pb2.Duration() if waits else None,
        resource_api_version=config_source_pb2.V3,
    )
    return secret_pb2.SdsSecretConfig(name=name, sds_config=source)

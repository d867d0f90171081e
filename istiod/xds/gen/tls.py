"""mTLS for proxyless gRPC: the transport sockets Istio's grpc generator adds. Pure.

gRPC takes certificates only from certificate provider instances named in its bootstrap; the agent
writes one called `default` (a file_watcher) whose `default` certificate is the workload's and
whose `ROOTCA` certificate is the mesh root.
"""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, tls_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import any_pb2, wrappers_pb2

from istiod.certfiles import PROVIDER_INSTANCE
from istiod.model.names import spiffe_identity
from istiod.model.service import Endpoint

TLS_TRANSPORT_SOCKET = "envoy.transport_sockets.tls"
IDENTITY_CERTIFICATE = "default"
ROOT_CERTIFICATE = "ROOTCA"


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

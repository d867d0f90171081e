"""SDS for gateways, on the ADS stream: `kubernetes://<name>` is the Secret `<name>` of the gateway's
namespace, as istiod serves credentialName. Only to a proxy whose identity was verified (istiod's
secure port): over plaintext xDS anyone may claim any namespace, so nothing is sent, as istiod."""

from __future__ import annotations

import logging

from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2

from istiod import logs
from istiod.model.credentials import TlsCredential
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.gateway.servers import CREDENTIAL_PREFIX

log = logging.getLogger(__name__)
_refused = logs.Throttled(log, 60.0)


def secrets(snapshot: Snapshot, proxy: Proxy, names: list[str] | None, cache: ResourceCache) -> list[Resource]:
    """Only the secrets asked for by name (a wildcard gets none); a missing one is left out, and the
    listener that needs it waits for it."""
    if not names:
        return []
    if not proxy.verified:
        _refused.warning(logs.event("gateway secrets not sent: identity not verified (use the TLS xDS port)",
                                    proxy=proxy.id))
        return []
    result = []
    for name in names:
        if not name.startswith(CREDENTIAL_PREFIX):
            continue
        credential = snapshot.credentials.get((proxy.namespace, name.removeprefix(CREDENTIAL_PREFIX)))
        if credential is None or not credential.usable:
            _refused.warning(logs.event("gateway secret not found or without tls.crt/tls.key", proxy=proxy.id,
                                        secret=f"{proxy.namespace}/{name.removeprefix(CREDENTIAL_PREFIX)}"))
            continue
        result.append(cache.get(types.SECRET, name, credential, lambda: tls_secret(name, credential),
                                scope=proxy.namespace))
    return result


def tls_secret(name: str, credential: TlsCredential) -> secret_pb2.Secret:
    return secret_pb2.Secret(name=name, tls_certificate=common_pb2.TlsCertificate(
        certificate_chain=base_pb2.DataSource(inline_bytes=credential.cert_chain),
        private_key=base_pb2.DataSource(inline_bytes=credential.private_key),
    ))

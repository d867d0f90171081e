"""SDS for gateways and sidecars, on the ADS stream: `kubernetes://<name>` is the Secret `<name>` of
the proxy's namespace, as istiod serves credentialName (a Gateway's, or a DestinationRule's for the
TLS a proxy originates), and `kubernetes://<name>-cacert` its CA (`cacert` or `ca.crt`, from the
Secret `<name>-cacert`, else `<name>`); `kubernetes-gateway://<ns>/<name>` a Gateway API
listener's certificateRef, sent only to a proxy one of whose listeners names it (the conversion
checked its ReferenceGrant). `<name>-cacert` is the CA verifying a MUTUAL server's clients: the
`ca.crt` of the Secret `<name>-cacert`, else of `<name>`, as istiod looks. `configmap://<ns>/<name>-cacert` is the
CA of a ConfigMap a BackendTLSPolicy names. Only to a proxy whose identity was verified (istiod's
secure port): over plaintext xDS anyone may claim any namespace, so nothing is sent, as istiod."""

from __future__ import annotations

import logging

from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2

from istiod import logs
from istiod.model.config.backend_tls import CONFIG_MAP_CREDENTIAL_PREFIX, config_map_ca
from istiod.model.config.networking import ClientTLS, DestinationRule
from istiod.model.credentials import TlsCredential
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.model.config.gateway_conversion import GATEWAY_CREDENTIAL_PREFIX
from istiod.xds.gen.gateway.servers import gateway_servers
from istiod.xds.gen.tls import CA_SUFFIX, CREDENTIAL_PREFIX

log = logging.getLogger(__name__)
_refused = logs.Throttled(log, 60.0)
_unreferenced = logs.Throttled(log, 60.0)  # its own budget: a client can cause it at will
_no_ca = logs.Throttled(log, 60.0)


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
    referenced: set[str] | None = None
    for name in names:
        if name.startswith(CONFIG_MAP_CREDENTIAL_PREFIX):
            root = _config_map_ca(snapshot, name)
            if root is None:
                _no_ca.warning(logs.event("configmap CA not found or not named by a BackendTLSPolicy", proxy=proxy.id,
                                          secret=name))
                continue
            result.append(cache.get(types.SECRET, name, root, lambda: ca_secret(name, root)))
            continue
        if name.startswith(CREDENTIAL_PREFIX) and name.endswith(CA_SUFFIX):
            secret = name.removeprefix(CREDENTIAL_PREFIX)
            ca = snapshot.credentials.get((proxy.namespace, secret))
            if ca is None or not ca.ca_cert:
                ca = snapshot.credentials.get((proxy.namespace, secret.removesuffix(CA_SUFFIX)))
            if ca is None or not ca.ca_cert:
                _no_ca.warning(logs.event("secret not found or without cacert/ca.crt", proxy=proxy.id,
                                          secret=f"{proxy.namespace}/{secret}"))
                continue
            result.append(cache.get(types.SECRET, name, ca, lambda: ca_secret(name, ca), scope=proxy.namespace))
            continue
        if name.startswith(CREDENTIAL_PREFIX):
            key = (proxy.namespace, name.removeprefix(CREDENTIAL_PREFIX))
        elif name.startswith(GATEWAY_CREDENTIAL_PREFIX):
            if referenced is None:
                referenced = {n for s in gateway_servers(snapshot, proxy) if s.terminates and not s.mesh_tls
                              for n in (*s.credentials, s.ca_credential) if n is not None}
            namespace, _, secret = name.removeprefix(GATEWAY_CREDENTIAL_PREFIX).partition("/")
            if name not in referenced:
                _unreferenced.warning(logs.event("gateway secret not sent: no listener of the proxy references it",
                                            proxy=proxy.id, secret=f"{namespace}/{secret}"))
                continue
            key = (namespace, secret)
        else:
            continue
        if key[1].endswith(CA_SUFFIX):
            found = [c for k in (key, (key[0], key[1].removesuffix(CA_SUFFIX)))
                     if (c := snapshot.credentials.get(k)) is not None and c.ca_cert]
            if not found:
                _refused.warning(logs.event("gateway CA secret not found or without ca.crt", proxy=proxy.id,
                                            secret=f"{key[0]}/{key[1]}"))
                continue
            result.append(cache.get(types.SECRET, name, found[0], lambda: ca_secret(name, found[0]),
                                    scope=proxy.namespace))
            continue
        credential = snapshot.credentials.get(key)
        if credential is None or not credential.usable:
            _refused.warning(logs.event("gateway secret not found or without tls.crt/tls.key", proxy=proxy.id,
                                        secret=f"{key[0]}/{key[1]}"))
            continue
        result.append(cache.get(types.SECRET, name, credential, lambda: tls_secret(name, credential),
                                scope=proxy.namespace))
    return result


def _config_map_ca(snapshot: Snapshot, name: str) -> TlsCredential | None:
    """`configmap://<ns>/<name>-cacert`: the CA of a ConfigMap a BackendTLSPolicy names (no secret: any
    proxy may have it, as istiod serves it; other ConfigMaps are not served)."""
    credential = name.removesuffix(CA_SUFFIX)
    if not any(tls.credential_name == credential for rule in snapshot.config.gateway_api.destination_rules
               for tls in _rule_tls(rule)):
        return None
    namespace, _, config_map = credential.removeprefix(CONFIG_MAP_CREDENTIAL_PREFIX).partition("/")
    found = next((c for c in snapshot.config.config_maps
                  if (c.meta.namespace, c.meta.name) == (namespace, config_map)), None)
    ca = config_map_ca(dict(found.data)) if found is not None else ""
    return TlsCredential(config_map, namespace, ca_cert=ca.encode()) if ca else None


def _rule_tls(rule: DestinationRule) -> list[ClientTLS]:
    policy = rule.traffic_policy
    if policy is None:
        return []
    return [tls for tls in (policy.tls, *(p.tls for p in policy.port_level_settings)) if tls is not None]


def ca_secret(name: str, credential: TlsCredential) -> secret_pb2.Secret:
    """istiod's toEnvoyCaSecret: the CA a client verifies its server with, and the CRL beside it."""
    context = common_pb2.CertificateValidationContext(trusted_ca=base_pb2.DataSource(inline_bytes=credential.ca_cert))
    if credential.crl:
        context.crl.inline_bytes = credential.crl
    return secret_pb2.Secret(name=name, validation_context=context)


def tls_secret(name: str, credential: TlsCredential) -> secret_pb2.Secret:
    return secret_pb2.Secret(name=name, tls_certificate=common_pb2.TlsCertificate(
        certificate_chain=base_pb2.DataSource(inline_bytes=credential.cert_chain),
        private_key=base_pb2.DataSource(inline_bytes=credential.private_key),
    ))

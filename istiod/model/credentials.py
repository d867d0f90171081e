"""TLS credentials from Kubernetes Secrets, as gateways and DestinationRules name them by `credentialName`."""

from __future__ import annotations

from dataclasses import dataclass, field

CA_SUFFIX = "-cacert"  # istiod's SdsCaSuffix: a credential's CA is served as `<credential>-cacert`


@dataclass(frozen=True, slots=True)
class TlsCredential:
    """A Secret's certificate chain and private key (PEM), and the CA certificates that verify
    clients of a MUTUAL gateway server (`ca.crt`). Never printed: repr leaves them out."""

    name: str
    namespace: str
    cert_chain: bytes = field(default=b"", repr=False)
    private_key: bytes = field(default=b"", repr=False)
    ca_cert: bytes = field(default=b"", repr=False)  # `cacert` or `ca.crt`: what a client verifies its server with
    crl: bytes = field(default=b"", repr=False)  # `crl` or `ca.crl` beside it

    @property
    def usable(self) -> bool:
        """A Secret that holds no certificate and key (a token, a docker config) is no credential."""
        return bool(self.cert_chain and self.private_key)


# Certificates mounted into the proxy's pod, which the agent reads and serves over its SDS (so a
# replaced file reaches Envoy without a restart), under pilot-agent's resource names.
FILE_CERT_PREFIX = "file-cert:"  # file-cert:<certificate chain>~<private key>
FILE_ROOT_PREFIX = "file-root:"  # file-root:<CA bundle>
FILE_SEPARATOR = "~"


def file_cert_resource(certificate: str, private_key: str) -> str:
    return f"{FILE_CERT_PREFIX}{certificate}{FILE_SEPARATOR}{private_key}"


def file_root_resource(ca_certificates: str) -> str:
    return FILE_ROOT_PREFIX + ca_certificates


def file_resource_paths(name: str) -> tuple[str, ...] | None:
    """The files a `file-cert:` (certificate, key) or `file-root:` (CA) resource names; None for another
    name, ValueError for a malformed one."""
    if name.startswith(FILE_CERT_PREFIX):
        certificate, separator, key = name.removeprefix(FILE_CERT_PREFIX).partition(FILE_SEPARATOR)
        if not (certificate and separator and key):
            raise ValueError(f"secret {name!r} is not {FILE_CERT_PREFIX}<certificate>{FILE_SEPARATOR}<key>")
        return certificate, key
    if name.startswith(FILE_ROOT_PREFIX):
        if not (ca := name.removeprefix(FILE_ROOT_PREFIX)):
            raise ValueError(f"secret {name!r} names no CA file")
        return (ca,)
    return None

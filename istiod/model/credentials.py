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

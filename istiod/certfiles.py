"""Names that the agent, the CA and the xDS generators must agree on, defined once.

Istio's file names for a workload's certificate files (also the plugged-in CA's chain and root,
and the ConfigMap key of the published root), and the certificate-provider instance that the
agent's bootstrap declares and istiod's TLS contexts refer to.
"""

from __future__ import annotations

CERT_CHAIN_FILE = "cert-chain.pem"
KEY_FILE = "key.pem"
ROOT_CERT_FILE = "root-cert.pem"
PROVIDER_INSTANCE = "default"  # the `file_watcher` instance in the bootstrap, named in every TLS context

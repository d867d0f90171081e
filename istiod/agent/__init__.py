"""The node-side helper of proxyless gRPC: bootstrap now; key, CSR and cert rotation later."""

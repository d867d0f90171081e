"""The IstioOperator install API: a spec mapped onto the Helm charts' values, rendered with helm."""

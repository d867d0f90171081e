"""Envoy sidecars: Istio's listeners, clusters and routes (networking/core), from upstream Envoy
extensions only. EDS is the shared generator (xds/gen/eds.py)."""

"""Operator-facing HTTP: /ready and the /debug endpoints, with istiod's names and shapes."""

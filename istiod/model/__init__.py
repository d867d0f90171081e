"""The mesh model: immutable values built from Kubernetes objects, and the Snapshot that joins them."""

"""Where Kubernetes objects come from (config dir, API informers) and the store they land in."""

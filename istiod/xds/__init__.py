"""xDS: the ADS server, per-connection state, the pusher and the serialized-resource cache."""

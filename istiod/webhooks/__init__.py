"""istiod's webhooks on 15017 (HTTPS): config validation."""

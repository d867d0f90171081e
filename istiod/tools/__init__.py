"""Operator tools that read istiod's debug endpoints: proxy-status and proxy-config."""

"""The agent's own metrics, with pilot-agent's names, in a registry of their own (merged on 15020
with Envoy's stats; istiod's metrics are not the agent's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from istiod.metrics import counters_without_total, exposition

REGISTRY = CollectorRegistry(auto_describe=True)

CERT_EXPIRY_SECONDS = Gauge(
    "istio_agent_cert_expiry_seconds",
    "The time remaining, in seconds, before the certificate chain will expire. A negative value indicates the cert is expired.",
    ["resource_name"], registry=REGISTRY,
)
OUTGOING_REQUESTS = Counter(
    "istio_agent_num_outgoing_requests", "Number of total outgoing requests (e.g. to a token exchange server, CA, etc.)",
    ["request_type"], registry=REGISTRY,
)
XDS_PROXY_REQUESTS = Counter("istio_agent_xds_proxy_requests", "The total number of Xds Proxy Requests", registry=REGISTRY)
XDS_PROXY_RESPONSES = Counter("istio_agent_xds_proxy_responses", "The total number of Xds Proxy Responses",
                              registry=REGISTRY)
SCRAPES = Counter("istio_agent_scrapes", "The total number of scrapes.", registry=REGISTRY)  # exposed with `_total`, as Istio's

_COUNTER_TOTAL = counters_without_total((OUTGOING_REQUESTS, XDS_PROXY_REQUESTS, XDS_PROXY_RESPONSES))


def agent_exposition() -> bytes:
    return exposition(REGISTRY, _COUNTER_TOTAL)

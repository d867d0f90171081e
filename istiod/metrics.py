"""Every Prometheus metric istiod exports, defined once, with Istio's names, labels and buckets.

Istio exports counters without the `_total` suffix (its OpenTelemetry exporter runs with
WithoutCounterSuffixes, for OpenCensus compatibility), so dashboards and alerts query
`pilot_xds_pushes`, not `pilot_xds_pushes_total`. prometheus-client always appends `_total` in its
text format; `exposition()` renames our counters back.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Iterator, Sequence

import prometheus_client
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

prometheus_client.disable_created_metrics()  # Istio exports no `*_created` series

_PUSH_BUCKETS = (0.01, 0.1, 1, 3, 5, 10, 20, 30)
_CONVERGENCE_BUCKETS = (0.1, 0.5, 1, 3, 5, 10, 20, 30)

# xDS server (pilot/pkg/xds/monitoring.go)
XDS_CLIENTS = Gauge("pilot_xds", "Number of endpoints connected to this pilot using XDS.", ["version"])
XDS_PUSHES = Counter("pilot_xds_pushes", "Pilot build and send errors for lds, rds, cds and eds.", ["type"])
XDS_PUSH_TIME = Histogram(
    "pilot_xds_push_time", "Total time in seconds Pilot takes to push lds, rds, cds and eds.", ["type"],
    buckets=_PUSH_BUCKETS,
)
CONFIG_SIZE_BYTES = Histogram(
    "pilot_xds_config_size_bytes", "Distribution of configuration sizes pushed to clients", ["type"],
    buckets=(1, 10_000, 1_000_000, 4_000_000, 10_000_000, 40_000_000),
)
PROXY_CONVERGENCE_TIME = Histogram(
    "pilot_proxy_convergence_time",
    "Delay in seconds between config change and a proxy receiving all required configuration.",
    buckets=_CONVERGENCE_BUCKETS,
)
PROXY_QUEUE_TIME = Histogram(
    "pilot_proxy_queue_time", "Time in seconds, a proxy is in the push queue before being dequeued.",
    buckets=_CONVERGENCE_BUCKETS,
)
XDS_WRITE_TIMEOUTS = Counter("pilot_xds_write_timeout", "Pilot XDS response write timeouts.")
TOTAL_XDS_REJECTS = Counter(
    "pilot_total_xds_rejects", "Total number of XDS responses from pilot rejected by proxy.", ["type"]
)
XDS_REJECTS = {  # by xDS short name; 1 for each proxy and error code that rejected config
    "cds": Gauge("pilot_xds_cds_reject", "Pilot rejected CDS configs.", ["node", "err"]),
    "eds": Gauge("pilot_xds_eds_reject", "Pilot rejected EDS.", ["node", "err"]),
    "lds": Gauge("pilot_xds_lds_reject", "Pilot rejected LDS.", ["node", "err"]),
    "rds": Gauge("pilot_xds_rds_reject", "Pilot rejected RDS.", ["node", "err"]),
}

# What each process serving xDS connections counts of them: with --xds-workers, the main process adds
# every worker's to its own (the rest, triggers and debounce, the main process alone counts).
CONNECTION_METRICS = (XDS_CLIENTS, XDS_PUSHES, XDS_PUSH_TIME, CONFIG_SIZE_BYTES, PROXY_CONVERGENCE_TIME,
                      PROXY_QUEUE_TIME, XDS_WRITE_TIMEOUTS, TOTAL_XDS_REJECTS, *XDS_REJECTS.values())
# 1 for each proxy and error code: not 2 when two connections of a proxy on two processes NACKed.
_LARGEST = frozenset(family.name for gauge in XDS_REJECTS.values() for family in gauge.describe())

# Push triggers and debouncing (pilot/pkg/xds/discovery.go, pilot/pkg/model/push_context.go)
PUSH_TRIGGERS = Counter("pilot_push_triggers", "Total number of times a push was triggered, labeled by reason for the push.", ["type"])
DEBOUNCE_TIME = Histogram(
    "pilot_debounce_time",
    "Delay in seconds between the first config enters debouncing and the merged push request is pushed into the push queue.",
    buckets=_PUSH_BUCKETS,
)
INBOUND_UPDATES = Counter("pilot_inbound_updates", "Total number of updates received by pilot.", ["type"])
SERVICES = Gauge("pilot_services", "Total services known to pilot.")
K8S_REG_EVENTS = Counter("pilot_k8s_reg_events", "Events from k8s registry.", ["type", "event"])
# The config dir (Istio's file monitor logs these; we count them too, so the state can be alerted on).
CONFIG_DIR_ERRORS = Counter(
    "pilot_config_dir_errors", "Config dir reads that failed and kept the last good state, by what failed.", ["type"]
)

# CA (security/pkg/server/ca/monitoring.go, security/pkg/pki/ca): defined here for the CA to record.
CSR_COUNT = Counter("citadel_server_csr_count", "The number of CSRs received by Citadel server.")
AUTHENTICATION_FAILURE_COUNT = Counter(
    "citadel_server_authentication_failure_count", "The number of authentication failures."
)
CSR_PARSING_ERR_COUNT = Counter("citadel_server_csr_parsing_err_count", "The number of errors occurred when parsing the CSR.")
ID_EXTRACTION_ERR_COUNT = Counter(
    "citadel_server_id_extraction_err_count", "The number of errors occurred when extracting the ID from CSR."
)
CSR_SIGN_ERR_COUNT = Counter(
    "citadel_server_csr_sign_err_count", "The number of errors occurred when signing the CSR.", ["error"]
)
SUCCESS_CERT_ISSUANCE_COUNT = Counter(
    "citadel_server_success_cert_issuance_count", "The number of certificates issuances that have succeeded."
)
ROOT_CERT_EXPIRY_TIMESTAMP = Gauge(
    "citadel_server_root_cert_expiry_timestamp", "The unix timestamp, in seconds, when Citadel root cert will expire."
)
ROOT_CERT_EXPIRY_SECONDS = Gauge(
    "citadel_server_root_cert_expiry_seconds", "The time remaining, in seconds, before the root cert will expire."
)
CERT_CHAIN_EXPIRY_TIMESTAMP = Gauge(
    "citadel_server_cert_chain_expiry_timestamp",
    "The unix timestamp, in seconds, when Citadel cert chain will expire.",
)
CERT_CHAIN_EXPIRY_SECONDS = Gauge(
    "citadel_server_cert_chain_expiry_seconds", "The time remaining, in seconds, before the cert chain will expire."
)

# istiod's own serving certificates, by server: xds (15012) and webhook (15017). Istio exports nothing
# for them (istio/istio#54662); named like the CA's gauges, so one alert rule shape covers both.
SERVING_CERT_EXPIRY_TIMESTAMP = Gauge(
    "istiod_serving_cert_expiry_timestamp", "The unix timestamp, in seconds, when istiod's serving certificate will expire.",
    ["server"],
)
SERVING_CERT_RENEWAL_FAILURES = Counter(
    "istiod_serving_cert_renewal_failures", "The number of failed renewals of istiod's serving certificate.", ["server"]
)


def counters_without_total(counters: Iterable[Counter]) -> re.Pattern[str]:
    """Matches these counters' `_total` in the text format, to be cut off (Istio's names)."""
    names = [family.name for counter in counters for family in counter.describe()]
    return re.compile(r"^((?:# (?:HELP|TYPE) )?(?:" + "|".join(map(re.escape, names)) + r"))_total\b", re.MULTILINE)


_COUNTER_TOTAL = counters_without_total(m for m in list(globals().values()) if isinstance(m, Counter))

# Kubernetes kinds -> Istio's update type (pilot_inbound_updates) and push trigger (pilot_push_triggers).
_UPDATE_TYPES = {"Service": "svc", "Pod": "eds", "EndpointSlice": "eds"}
_TRIGGERS = {"svc": "service", "eds": "endpoint", "config": "config"}


def update_type(kind: str) -> str:
    return _UPDATE_TYPES.get(kind, "config")


def trigger_type(kind: str) -> str:
    return _TRIGGERS[update_type(kind)]


def connection_families() -> list[Metric]:
    """This process's CONNECTION_METRICS, for the main process to add (pickles)."""
    return [family for metric in CONNECTION_METRICS for family in metric.collect()]


def exposition(registry: CollectorRegistry = REGISTRY, counter_total: re.Pattern[str] = _COUNTER_TOTAL,
               others: Sequence[Iterable[Metric]] = ()) -> bytes:
    """The Prometheus text format of a registry (istiod's by default), counters named as Istio names them;
    `others`: the connection_families() of other processes, added to the registry's."""
    if others:
        merged = CollectorRegistry(auto_describe=False)
        merged.register(_Added(registry, others))
        registry = merged
    return counter_total.sub(r"\1", generate_latest(registry).decode()).encode()


class _Added(Collector):
    def __init__(self, registry: CollectorRegistry, others: Sequence[Iterable[Metric]]) -> None:
        self.registry = registry
        self.others: dict[str, list[Metric]] = {}
        for families in others:
            for family in families:
                self.others.setdefault(family.name, []).append(family)

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            others = self.others.get(family.name)
            yield _added(family, others) if others else family


def _added(family: Metric, others: list[Metric]) -> Metric:
    """One family from several processes': the values of each series added (of _LARGEST, the largest)."""
    combine = max if family.name in _LARGEST else operator.add
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {}
    for one in (family, *others):
        for sample in one.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            held = samples.get(key)
            samples[key] = sample if held is None else held._replace(value=combine(held.value, sample.value))
    result = Metric(family.name, family.documentation, family.type, family.unit)
    result.samples = list(samples.values())
    return result

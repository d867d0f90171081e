"""The CA's metrics, with Istio's names (`citadel_server_*`).

prometheus_client exposes a Counter `x` as `x_total`; the lead reconciles exposition with
istiod/metrics.py at merge.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

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
CERT_CHAIN_EXPIRY_TIMESTAMP = Gauge(
    "citadel_server_cert_chain_expiry_timestamp",
    "The unix timestamp, in seconds, when Citadel cert chain will expire.",
)

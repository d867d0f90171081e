"""EnvoyFilter (networking.istio.io/v1alpha3): patches to the Envoy config istiod makes, as values.

A patch's value is kept serialized (the message type follows from `apply_to`), so the object stays
immutable and hashable; xds/gen/envoyfilter.py applies the patches.
"""

from __future__ import annotations

from dataclasses import dataclass

from istiod.model.config.common import Labels, Meta

# applyTo values this istiod applies (LISTENER_FILTER, EXTENSION_CONFIG and BOOTSTRAP are refused).
LISTENER, FILTER_CHAIN, NETWORK_FILTER, HTTP_FILTER = "LISTENER", "FILTER_CHAIN", "NETWORK_FILTER", "HTTP_FILTER"
ROUTE_CONFIGURATION, VIRTUAL_HOST, HTTP_ROUTE, CLUSTER = "ROUTE_CONFIGURATION", "VIRTUAL_HOST", "HTTP_ROUTE", "CLUSTER"
APPLY_TO = (LISTENER, FILTER_CHAIN, NETWORK_FILTER, HTTP_FILTER, ROUTE_CONFIGURATION, VIRTUAL_HOST, HTTP_ROUTE, CLUSTER)
OPERATIONS = ("MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST", "REPLACE",
              "MERGE_AND_REPLACE_LIST")
CONTEXTS = ("ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY")
ROUTE_ACTIONS = ("ANY", "ROUTE", "REDIRECT", "DIRECT_RESPONSE")
# What istiod's validation warns of every EnvoyFilter (the webhook's admission warning, analyze's IST0133).
WARNING = ("EnvoyFilter exposes internal implementation details that may change at any time. Prefer other APIs if "
           "possible, and exercise extreme caution, especially around upgrades.")
HCM_NAMES = ("envoy.filters.network.http_connection_manager", "envoy.http_connection_manager")  # the second deprecated


@dataclass(frozen=True, slots=True)
class ListenerMatch:
    port_number: int = 0
    name: str = ""
    # filterChain: its name, SNI, transport and application protocols (comma-separated, all
    # present), destination port; a network filter by name and an HTTP filter (subFilter) in it.
    chain: bool = False  # filterChain was given
    chain_name: str = ""
    sni: str = ""
    transport_protocol: str = ""
    application_protocols: str = ""
    destination_port: int = 0
    filter_name: str = ""
    sub_filter_name: str = ""


@dataclass(frozen=True, slots=True)
class RouteMatch:
    """routeConfiguration: the route configuration, a virtual host (vhost) in it, a route in that."""

    port_number: int = 0
    port_name: str = ""
    gateway: str = ""
    name: str = ""
    vhost: bool = False  # vhost was given
    vhost_name: str = ""
    domain_name: str = ""
    route: bool = False  # vhost.route was given
    route_name: str = ""
    action: str = "ANY"


@dataclass(frozen=True, slots=True)
class ClusterMatch:
    port_number: int = 0
    service: str = ""
    subset: str = ""
    name: str = ""


@dataclass(frozen=True, slots=True)
class ConfigPatch:
    apply_to: str
    operation: str
    value: bytes  # the serialized message of apply_to's type; empty for REMOVE
    context: str = "ANY"
    proxy_version: str = ""  # a regular expression on the proxy's ISTIO_VERSION
    listener: ListenerMatch | None = None
    route_configuration: RouteMatch | None = None
    cluster: ClusterMatch | None = None


@dataclass(frozen=True, slots=True)
class EnvoyFilter:
    meta: Meta
    patches: tuple[ConfigPatch, ...]
    workload_selector: Labels = ()
    priority: int = 0
    created: str = ""  # metadata.creationTimestamp (RFC 3339: orders as it reads), istiod's tie-break

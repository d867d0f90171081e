"""Mesh-wide settings the generators read: the parts of Istio's MeshConfig istiod implements."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from istiod.model.config.networking import LocalityLbSetting
from istiod.model.labels import Selector
from istiod.model.names import DEFAULT_DOMAIN

DEFAULT_TRUST_DOMAIN = DEFAULT_DOMAIN  # istiod's default trust domain is cluster.local too
DEFAULT_ROOT_NAMESPACE = "istio-system"


@dataclass(frozen=True, slots=True, order=True)
class NetworkGateway:
    """meshNetworks' gateway of a network: where proxies of other networks send its endpoints'
    mTLS traffic (an east-west gateway, AUTO_PASSTHROUGH on 15443)."""

    network: str
    address: str
    port: int


@dataclass(frozen=True, slots=True, order=True)
class NetworkCidr:
    """meshNetworks' `endpoints: [{fromCidr}]`: endpoints without a network of their own whose IP
    is in `cidr` are in `network`."""

    network: str
    cidr: str


class OutboundTrafficPolicy(enum.Enum):
    ALLOW_ANY = "ALLOW_ANY"
    REGISTRY_ONLY = "REGISTRY_ONLY"


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """defaultConfig: what proxies get unless ProxyConfig objects or their own annotation say otherwise."""

    discovery_address: str = "istiod.istio-system.svc:15012"
    proxy_metadata: tuple[tuple[str, str], ...] = ()
    hold_application_until_proxy_starts: bool = False
    json: str = ""  # every field as set (JSON text, immutable): the base of an injected pod's PROXY_CONFIG


@dataclass(frozen=True, slots=True)
class ExtAuthzProvider:
    """extensionProviders[]: envoyExtAuthzHttp or envoyExtAuthzGrpc, the external authorizer
    AuthorizationPolicies with action CUSTOM name."""

    name: str
    grpc: bool  # envoyExtAuthzGrpc (else HTTP)
    service: str  # `host` or `namespace/host`
    port: int
    timeout: float | None = None  # seconds; None: Istio's 600 s
    fail_open: bool = False
    status_on_error: int | None = None
    path_prefix: str = ""
    include_request_headers_in_check: tuple[str, ...] = ()
    include_additional_headers_in_check: tuple[tuple[str, str], ...] = ()
    headers_to_upstream_on_allow: tuple[str, ...] = ()
    headers_to_downstream_on_deny: tuple[str, ...] = ()
    headers_to_downstream_on_allow: tuple[str, ...] = ()
    request_body: RequestBody | None = None  # includeRequestBodyInCheck
    clear_route_cache: bool = False  # the route is picked again after the authorizer's header changes


@dataclass(frozen=True, slots=True)
class RequestBody:
    """includeRequestBodyInCheck: the request body the authorizer is sent (Envoy buffers it)."""

    max_request_bytes: int = 0
    allow_partial_message: bool = False
    pack_as_bytes: bool = False


@dataclass(frozen=True, slots=True)
class AccessLogSettings:
    """meshConfig accessLogFile, accessLogEncoding (TEXT or JSON) and accessLogFormat ("": Istio's)."""

    path: str
    encoding: str = "TEXT"
    format: str = ""


@dataclass(frozen=True, slots=True)
class MeshConfig:
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    # Mesh-wide mTLS between proxyless gRPC workloads (STRICT); PeerAuthentication and
    # DestinationRule will refine it per workload and service.
    mtls: bool = False
    root_namespace: str = DEFAULT_ROOT_NAMESPACE
    outbound_traffic_policy: OutboundTrafficPolicy = OutboundTrafficPolicy.ALLOW_ANY
    enable_auto_mtls: bool = True
    default_config: ProxyConfig = ProxyConfig()
    discovery_selectors: tuple[Selector, ...] = ()  # none: every namespace
    trust_domain_aliases: tuple[str, ...] = ()  # other trust domains whose identities istiod accepts as its own
    # The default of every DestinationRule's; Istio's mesh default is `enabled: true`, which takes
    # effect where a rule sets outlierDetection (failover by locality). None: locality LB off.
    locality_lb_setting: LocalityLbSetting | None = LocalityLbSetting(enabled=True)
    extension_providers: tuple[ExtAuthzProvider, ...] = ()  # the external authorizers (others are ignored)
    # How long listeners that sniff a port's protocol wait for the client's first bytes (seconds);
    # Istio's default 0 waits forever (a server-first protocol on a sniffed port hangs, as in Istio).
    protocol_detection_timeout: float = 0.0
    access_log: AccessLogSettings | None = None  # accessLogFile (and its encoding, format); None: off
    # The exportTo of Services and ServiceEntries, VirtualServices and DestinationRules that set none
    # (empty: Istio's default, `*`).
    default_service_export_to: tuple[str, ...] = ()
    default_virtual_service_export_to: tuple[str, ...] = ()
    default_destination_rule_export_to: tuple[str, ...] = ()
    network_gateways: tuple[NetworkGateway, ...] = ()  # meshNetworks' gateways, sorted
    # What the gateways' hostnames (meshNetworks addresses, LoadBalancer ingress hostnames) resolved
    # to, by istiod/gatewaynames.py: hostname -> IPs, sorted. Not read from any config.
    gateway_addresses: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # The network of endpoints without one of their own: meshNetworks' `fromRegistry` naming our
    # cluster ID (it wins, as istiod), else the first `fromCidr` holding the IP.
    registry_network: str = ""
    network_cidrs: tuple[NetworkCidr, ...] = ()
    # istiod's own namespace (POD_NAMESPACE): its `topology.istio.io/network` label is the network of
    # endpoints that name none (before meshNetworks' endpoints, as istiod).
    system_namespace: str = DEFAULT_ROOT_NAMESPACE

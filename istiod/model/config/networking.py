"""networking.istio.io values: VirtualService, DestinationRule, ServiceEntry, Gateway, Sidecar, WorkloadEntry.

Hosts are stored resolved as istiod resolves them: a short name (no dot) in the object's namespace
becomes `<name>.<namespace>.svc.<domain>`; anything else stays as written. Gateway references
become `<namespace>/<name>` (or `mesh`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from istiod.model.config.common import Duration, Labels, Meta, StringMatch
from istiod.model.probe import ReadinessProbe

MESH_GATEWAY = "mesh"
JWT_CLAIM_HEADER = "@request.auth.claims"  # a header match on this routes by a verified token's claim


def routing_claim(header: str) -> tuple[str, ...] | None:
    """The claim path of a header match name `@request.auth.claims.a.b` or `...[a][b]`, else None."""
    if not header.lower().startswith(JWT_CLAIM_HEADER):
        return None
    name = header[len(JWT_CLAIM_HEADER):]
    if name.startswith(".") and len(name) > 1:
        return tuple(name[1:].split("."))
    if name.startswith("[") and name.endswith("]") and len(name) > 2:
        return tuple(name[1:-1].split("]["))
    return None


# --- VirtualService ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Destination:
    host: str
    subset: str = ""
    port: int = 0  # 0: the only port of the service, or the port the request came in on


@dataclass(frozen=True, slots=True)
class HeaderOperations:
    set: Labels = ()
    add: Labels = ()
    remove: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Headers:
    request: HeaderOperations = HeaderOperations()
    response: HeaderOperations = HeaderOperations()


@dataclass(frozen=True, slots=True)
class RouteDestination:
    destination: Destination
    weight: int = 0  # 0 with one destination means all traffic, as istiod reads it
    headers: Headers = Headers()


@dataclass(frozen=True, slots=True)
class HTTPMatch:
    name: str = ""
    uri: StringMatch | None = None
    scheme: StringMatch | None = None
    method: StringMatch | None = None
    authority: StringMatch | None = None
    headers: tuple[tuple[str, StringMatch], ...] = ()
    without_headers: tuple[tuple[str, StringMatch], ...] = ()
    query_params: tuple[tuple[str, StringMatch], ...] = ()
    port: int = 0
    source_labels: Labels = ()
    gateways: tuple[str, ...] = ()
    source_namespace: str = ""
    ignore_uri_case: bool = False
    stat_prefix: str = ""  # the route's own stats under this prefix


@dataclass(frozen=True, slots=True)
class FaultDelay:
    fixed_delay: Duration
    percentage: float = 100.0


@dataclass(frozen=True, slots=True)
class FaultAbort:
    http_status: int = 0
    grpc_status: str = ""  # a gRPC code name (UNAVAILABLE, ...)
    percentage: float = 100.0


@dataclass(frozen=True, slots=True)
class Fault:
    delay: FaultDelay | None = None
    abort: FaultAbort | None = None


@dataclass(frozen=True, slots=True)
class Retries:
    attempts: int
    per_try_timeout: Duration | None = None
    retry_on: tuple[str, ...] = ()  # Envoy retry_on names, gRPC code names, HTTP status numbers
    retry_remote_localities: bool | None = None
    backoff: Duration | None = None  # base interval between retries (Envoy's default: 25ms)
    retry_ignore_previous_hosts: bool | None = None  # None: istiod's default (true)


@dataclass(frozen=True, slots=True)
class Rewrite:
    uri: str = ""
    authority: str = ""
    uri_regex: tuple[str, str] | None = None  # (match, rewrite)


@dataclass(frozen=True, slots=True)
class Redirect:
    uri: str = ""
    authority: str = ""
    scheme: str = ""
    port: int = 0
    derive_port: str = ""  # FROM_PROTOCOL_DEFAULT or FROM_REQUEST_PORT
    code: int = 301
    prefix_rewrite: str = ""  # in place of the matched prefix (routes matching by prefix only)


@dataclass(frozen=True, slots=True)
class DirectResponse:
    status: int
    body: str | bytes | None = None


@dataclass(frozen=True, slots=True)
class Mirror:
    destination: Destination
    # Of requests, 0-100. An int is a count per hundred, a float per million, as istiod spells
    # the deprecated integer `mirrorPercent` (and the default 100) and `percentage` in Envoy's config.
    percentage: float | int = 100


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    allow_origins: tuple[StringMatch, ...] = ()
    allow_methods: tuple[str, ...] = ()
    allow_headers: tuple[str, ...] = ()
    expose_headers: tuple[str, ...] = ()
    max_age: Duration | None = None
    allow_credentials: bool | None = None
    unmatched_preflights: str = "FORWARD"  # FORWARD (to the upstream) or IGNORE (answered by Envoy)


@dataclass(frozen=True, slots=True)
class HTTPRoute:
    name: str = ""
    match: tuple[HTTPMatch, ...] = ()  # empty: every request
    route: tuple[RouteDestination, ...] = ()  # empty with a redirect or a direct response
    redirect: Redirect | None = None
    direct_response: DirectResponse | None = None
    rewrite: Rewrite | None = None
    timeout: Duration | None = None
    retries: Retries | None = None  # None: istiod's default retry policy
    fault: Fault | None = None
    headers: Headers = Headers()
    mirrors: tuple[Mirror, ...] = ()  # each request also sent, unanswered, to these
    cors_policy: CorsPolicy | None = None
    # (namespace, name) of the VirtualService whose routes stand here (a root's route); merged away
    # when the config set is collected (istiod/model/config/delegate.py).
    delegate: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class L4Match:
    destination_subnets: tuple[str, ...] = ()
    port: int = 0
    source_labels: Labels = ()
    gateways: tuple[str, ...] = ()
    source_namespace: str = ""
    sni_hosts: tuple[str, ...] = ()  # TLS routes only


@dataclass(frozen=True, slots=True)
class L4Route:
    """A TCP or TLS route: the first whose match holds sends to its weighted destinations."""

    match: tuple[L4Match, ...] = ()
    route: tuple[RouteDestination, ...] = ()


@dataclass(frozen=True, slots=True)
class VirtualService:
    meta: Meta
    hosts: tuple[str, ...]  # none: a delegate, whose http routes stand in a root's delegating route
    gateways: tuple[str, ...] = (MESH_GATEWAY,)  # `mesh`, or `<namespace>/<name>`
    http: tuple[HTTPRoute, ...] = ()
    tcp: tuple[L4Route, ...] = ()
    tls: tuple[L4Route, ...] = ()
    export_to: tuple[str, ...] = ()
    # Made from the Gateway API: path prefixes match whole segments (`/a` is not `/ab`), as istiod's
    # UseGatewaySemantics.
    gateway_semantics: bool = False


# --- DestinationRule --------------------------------------------------------------------------

class LoadBalancer(enum.Enum):
    UNSPECIFIED = "UNSPECIFIED"
    LEAST_REQUEST = "LEAST_REQUEST"
    RANDOM = "RANDOM"
    PASSTHROUGH = "PASSTHROUGH"
    ROUND_ROBIN = "ROUND_ROBIN"
    LEAST_CONN = "LEAST_CONN"  # istiod reads it as LEAST_REQUEST


@dataclass(frozen=True, slots=True)
class HTTPCookie:
    name: str
    path: str = ""
    ttl: Duration | None = None
    attributes: tuple[tuple[str, str], ...] = ()  # (name, value): Envoy adds them to the Set-Cookie


class HashAlgorithm(enum.Enum):
    RING_HASH = "ringHash"
    MAGLEV = "maglev"


@dataclass(frozen=True, slots=True)
class ConsistentHash:
    http_header_name: str = ""
    http_cookie: HTTPCookie | None = None
    use_source_ip: bool = False
    http_query_parameter_name: str = ""
    minimum_ring_size: int = 0  # the deprecated top-level field
    # ringHash or maglev, with its minimumRingSize / tableSize (0: Envoy's default); None: the old form.
    algorithm: HashAlgorithm | None = None
    table_size: int = 0


@dataclass(frozen=True, slots=True)
class LocalityFailover:
    from_region: str
    to_region: str


@dataclass(frozen=True, slots=True)
class LocalityDistribute:
    """Traffic from proxies in `from_locality` goes to the `to` localities by weight (they sum to 100);
    localities are `region/zone/subzone`, a trailing `*` matching any."""

    from_locality: str
    to: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class LocalityLbSetting:
    distribute: tuple[LocalityDistribute, ...] = ()
    failover: tuple[LocalityFailover, ...] = ()
    failover_priority: tuple[str, ...] = ()  # label names, or `name=value` overriding the proxy's value
    enabled: bool | None = None


@dataclass(frozen=True, slots=True)
class Warmup:
    """Envoy's slow start: a new endpoint's weight ramps up over `duration`."""

    duration: Duration
    aggression: float = 1.0  # Istio's default: linear
    minimum_percent: float = 10.0  # Envoy's default, which Istio sets explicitly


@dataclass(frozen=True, slots=True)
class LoadBalancerSettings:
    simple: LoadBalancer | None = None
    consistent_hash: ConsistentHash | None = None
    locality_lb_setting: LocalityLbSetting | None = None
    # warmupDurationSecs becomes a Warmup with only the window set (no aggression/min percent), as Istio.
    warmup: Warmup | None = None
    warmup_window_only: bool = False


@dataclass(frozen=True, slots=True)
class TcpKeepalive:
    probes: int = 0
    time: Duration | None = None
    interval: Duration | None = None


@dataclass(frozen=True, slots=True)
class TCPSettings:
    max_connections: int = 0
    connect_timeout: Duration | None = None
    tcp_keepalive: TcpKeepalive | None = None
    max_connection_duration: Duration | None = None
    idle_timeout: Duration | None = None


class H2UpgradePolicy(enum.Enum):
    DEFAULT = "DEFAULT"
    DO_NOT_UPGRADE = "DO_NOT_UPGRADE"
    UPGRADE = "UPGRADE"


@dataclass(frozen=True, slots=True)
class HTTPSettings:
    http1_max_pending_requests: int = 0
    http2_max_requests: int = 0
    max_requests_per_connection: int = 0
    max_retries: int = 0
    idle_timeout: Duration | None = None
    max_concurrent_streams: int = 0
    h2_upgrade_policy: H2UpgradePolicy = H2UpgradePolicy.DEFAULT
    use_client_protocol: bool = False


@dataclass(frozen=True, slots=True)
class ConnectionPool:
    tcp: TCPSettings | None = None
    http: HTTPSettings | None = None


@dataclass(frozen=True, slots=True)
class OutlierDetection:
    consecutive_5xx_errors: int | None = None
    consecutive_gateway_errors: int | None = None
    interval: Duration | None = None
    base_ejection_time: Duration | None = None
    max_ejection_percent: int | None = None
    min_health_percent: int | None = None
    split_external_local_origin_errors: bool = False
    consecutive_local_origin_failures: int | None = None


class TLSMode(enum.Enum):
    DISABLE = "DISABLE"
    SIMPLE = "SIMPLE"
    MUTUAL = "MUTUAL"
    ISTIO_MUTUAL = "ISTIO_MUTUAL"


@dataclass(frozen=True, slots=True)
class ClientTLS:
    mode: TLSMode = TLSMode.DISABLE
    client_certificate: str = ""
    private_key: str = ""
    ca_certificates: str = ""  # empty: the system's CA bundle, unless insecure_skip_verify
    subject_alt_names: tuple[str, ...] = ()
    sni: str = ""
    insecure_skip_verify: bool | None = None
    ca_crl: str = ""  # a file in the proxy: the CRL Envoy checks the server's chain against
    credential_name: str = ""  # a Secret of the proxy's namespace, over SDS, instead of the files


@dataclass(frozen=True, slots=True)
class PortTrafficPolicy:
    port: int
    load_balancer: LoadBalancerSettings | None = None
    connection_pool: ConnectionPool | None = None
    outlier_detection: OutlierDetection | None = None
    tls: ClientTLS | None = None


@dataclass(frozen=True, slots=True)
class RetryBudget:
    """Retries to a host at once, bounded by a share of its active requests (Istio's
    TrafficPolicy.RetryBudget; here made by XBackendTrafficPolicy): Envoy's circuit-breaker retry budget."""

    percent: float | None = None  # of active and pending requests; Envoy's default (istiod's) 20
    min_retry_concurrency: int = 0  # 0: istiod's default, 3
    interval: Duration | None = None  # new requests of this long count too (none: only active ones)


@dataclass(frozen=True, slots=True)
class TunnelSettings:
    """TCP to the host is carried in an HTTP CONNECT (or POST) to `target_host:target_port`: the
    host is a proxy that opens the connection to the target."""

    target_host: str
    target_port: int
    use_post: bool = False

    @property
    def hostname(self) -> str:
        """`host:port`, an IPv6 address in brackets (Go's net.JoinHostPort, as istiod writes it)."""
        return f"[{self.target_host}]:{self.target_port}" if ":" in self.target_host else \
            f"{self.target_host}:{self.target_port}"


@dataclass(frozen=True, slots=True)
class TrafficPolicy:
    load_balancer: LoadBalancerSettings | None = None
    connection_pool: ConnectionPool | None = None
    outlier_detection: OutlierDetection | None = None
    tls: ClientTLS | None = None
    port_level_settings: tuple[PortTrafficPolicy, ...] = ()
    proxy_protocol: int | None = None  # the PROXY protocol version (1 or 2) sent first to the upstream
    tunnel: TunnelSettings | None = None
    retry_budget: RetryBudget | None = None  # not at port level (a port's settings replace it, as istiod)


@dataclass(frozen=True, slots=True)
class Subset:
    name: str
    labels: Labels = ()
    traffic_policy: TrafficPolicy | None = None


@dataclass(frozen=True, slots=True)
class DestinationRule:
    meta: Meta
    host: str
    traffic_policy: TrafficPolicy | None = None
    subsets: tuple[Subset, ...] = ()
    export_to: tuple[str, ...] = ()
    workload_selector: Labels = ()

    def subset(self, name: str) -> Subset | None:
        return next((s for s in self.subsets if s.name == name), None)


# --- ServiceEntry, WorkloadEntry --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ServicePort:
    number: int
    protocol: str  # upper case (HTTP, HTTPS, GRPC, HTTP2, TCP, TLS, ...); "" on a ServiceEntry: sniffed
    name: str
    target_port: int = 0


HEALTH_CHECKS_ANNOTATION = "proxy.istio.io/health-checks-enabled"  # a WorkloadEntry's agent reports its health


@dataclass(frozen=True, slots=True)
class WorkloadEntry:
    meta: Meta  # for an inline ServiceEntry endpoint, the ServiceEntry's
    address: str = ""
    ports: tuple[tuple[str, int], ...] = ()  # port name -> number
    labels: Labels = ()
    network: str = ""
    locality: str = ""
    weight: int = 0
    service_account: str = ""
    # False while health checks are enabled for it (annotation `proxy.istio.io/health-checks-enabled`)
    # and its status has no Healthy condition that is True, as istiod's isHealthy.
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class WorkloadGroup:
    """What an auto-registered WorkloadEntry is made of (istiod/autoregistration.py)."""

    meta: Meta
    uid: str  # for the entries' owner reference
    labels: Labels  # spec.metadata's
    annotations: Labels
    template: WorkloadEntry  # its address is the connecting proxy's
    probe: ReadinessProbe | None = None  # run by the workload's agent (it sends the result)


class Location(enum.Enum):
    MESH_EXTERNAL = "MESH_EXTERNAL"
    MESH_INTERNAL = "MESH_INTERNAL"


class Resolution(enum.Enum):
    NONE = "NONE"
    STATIC = "STATIC"
    DNS = "DNS"
    DNS_ROUND_ROBIN = "DNS_ROUND_ROBIN"


@dataclass(frozen=True, slots=True)
class ServiceEntry:
    meta: Meta
    hosts: tuple[str, ...]
    ports: tuple[ServicePort, ...] = ()
    addresses: tuple[str, ...] = ()
    location: Location = Location.MESH_EXTERNAL
    resolution: Resolution = Resolution.NONE
    endpoints: tuple[WorkloadEntry, ...] = ()
    workload_selector: Labels = ()
    export_to: tuple[str, ...] = ()
    subject_alt_names: tuple[str, ...] = ()


# --- Gateway ----------------------------------------------------------------------------------

class ServerTLSMode(enum.Enum):
    PASSTHROUGH = "PASSTHROUGH"
    SIMPLE = "SIMPLE"
    MUTUAL = "MUTUAL"
    AUTO_PASSTHROUGH = "AUTO_PASSTHROUGH"
    ISTIO_MUTUAL = "ISTIO_MUTUAL"
    OPTIONAL_MUTUAL = "OPTIONAL_MUTUAL"


# ServerTLSSettings' TLSProtocol values, lowest first.
TLS_PROTOCOL_VERSIONS = ("TLSV1_0", "TLSV1_1", "TLSV1_2", "TLSV1_3")


@dataclass(frozen=True, slots=True)
class ServerTLS:
    mode: ServerTLSMode = ServerTLSMode.PASSTHROUGH
    https_redirect: bool = False
    server_certificate: str = ""
    private_key: str = ""
    ca_certificates: str = ""
    credential_name: str = ""
    subject_alt_names: tuple[str, ...] = ()
    min_protocol_version: str = ""  # "", TLS_AUTO or one of TLS_PROTOCOL_VERSIONS
    max_protocol_version: str = ""
    cipher_suites: tuple[str, ...] = ()
    # Several Secrets served together (e.g. an RSA and an ECDSA certificate); the first one's CA verifies clients.
    credential_names: tuple[str, ...] = ()
    verify_certificate_spki: tuple[str, ...] = ()  # base64 SHA-256 of a client's SubjectPublicKeyInfo
    verify_certificate_hash: tuple[str, ...] = ()  # hex SHA-256 of a client's certificate
    # istiod's caCertCredentialName (a Gateway API frontend validation's CA): the SDS name of the CA
    # verifying clients instead of the first credential's `-cacert`.
    ca_cert_credential_name: str = ""
    ca_crl: str = ""  # a CRL file in the proxy (ISTIO_MUTUAL); a credential's CRL is its Secret's ca.crl
    # The client's certificate is asked for and passed on (XFCC) but its chain not verified: the
    # Gateway API's AllowInsecureFallback, as istiod's insecureSkipVerify.
    insecure_skip_verify: bool = False
    # tlsCertificates: (serverCertificate, privateKey) file pairs served together (e.g. RSA and ECDSA).
    tls_certificates: tuple[tuple[str, str], ...] = ()

    @property
    def certificate_files(self) -> tuple[tuple[str, str], ...]:
        """The (certificate, key) files of the server: tlsCertificates, else serverCertificate/privateKey."""
        if self.tls_certificates:
            return self.tls_certificates
        return ((self.server_certificate, self.private_key),) if self.server_certificate and self.private_key else ()

    @property
    def credentials(self) -> tuple[str, ...]:
        """The Secrets the server's certificates come from: credentialNames, else credentialName."""
        return self.credential_names or ((self.credential_name,) if self.credential_name else ())


@dataclass(frozen=True, slots=True)
class Server:
    port: ServicePort
    hosts: tuple[tuple[str, str], ...]  # (namespace or "*" or ".", dnsName)
    bind: str = ""
    tls: ServerTLS | None = None
    name: str = ""


@dataclass(frozen=True, slots=True)
class Gateway:
    meta: Meta
    servers: tuple[Server, ...]
    selector: Labels = ()


# --- Sidecar ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class IngressListener:
    port: ServicePort
    bind: str = ""
    default_endpoint: str = ""
    capture_mode: str = "DEFAULT"
    connection_pool: ConnectionPool | None = None
    tls: ServerTLS | None = None  # the sidecar terminates the caller's TLS (SIMPLE, MUTUAL, OPTIONAL_MUTUAL)


@dataclass(frozen=True, slots=True)
class EgressListener:
    hosts: tuple[tuple[str, str], ...]  # (namespace or "*" or "." or "~", dnsName)
    port: ServicePort | None = None
    bind: str = ""
    capture_mode: str = "DEFAULT"


@dataclass(frozen=True, slots=True)
class Sidecar:
    meta: Meta
    egress: tuple[EgressListener, ...] = ()
    ingress: tuple[IngressListener, ...] = ()
    workload_selector: Labels = ()
    outbound_traffic_policy: str = ""  # "" (the mesh's), ALLOW_ANY or REGISTRY_ONLY
    inbound_connection_pool: ConnectionPool | None = None
    egress_proxy: Destination | None = None  # with ALLOW_ANY: where traffic to unknown destinations goes

    def connection_pool_for(self, port: int) -> ConnectionPool | None:
        """An inbound port's pool: its ingress listener's, else the Sidecar's (istiod's precedence,
        over any DestinationRule's)."""
        for listener in self.ingress:
            if listener.port.number == port and listener.connection_pool is not None:
                return listener.connection_pool
        return self.inbound_connection_pool

"""gateway.networking.k8s.io values: GatewayClass, Gateway (KubernetesGateway, as istiod names it to
tell it from Istio's Gateway), HTTPRoute, GRPCRoute, TLSRoute and TCPRoute (one model: gRPC methods
are paths; TLS and TCP rules have backends only), ReferenceGrant. Validated on the way in (istiod/sources/gateway_api.py);
istiod/model/config/gateway_conversion.py turns them into Istio's Gateway and VirtualService.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from istiod.model.config.common import Duration, Labels, Meta, StringMatch
from istiod.model.labels import Selector
from istiod.model.config.networking import (
    CorsPolicy, DestinationRule, Gateway, HeaderOperations, Headers, Retries, RetryBudget, VirtualService,
)

WAYPOINT_CLASS = "istio-waypoint"  # the mesh controller's class: waypoints
CONTROLLER = "istio.io/gateway-controller"
MESH_CONTROLLER = "istio.io/mesh-controller"  # waypoints'
USE_WAYPOINT_LABEL = "istio.io/use-waypoint"  # on a Service or namespace: the waypoint its traffic goes through
GROUP = "gateway.networking.k8s.io"
VERSIONS = ("v1", "v1beta1", "v1alpha2")  # every kind is read at v1, which v1.6.0 serves for all
# The store's kind names: istiod's, so Istio's Gateway keeps "Gateway".
KIND_NAMES = {"Gateway": "KubernetesGateway"}
L4_ROUTE_KINDS = ("TCPRoute", "TLSRoute")


def condition(type_: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    """A metav1.Condition without its lastTransitionTime (the status writer keeps or sets it)."""
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message,
            "observedGeneration": generation}


@dataclass(frozen=True, slots=True)
class ConfigMap:
    """A ConfigMap, as the gateway deployment reads one: a Gateway's parametersRef, or its class's defaults
    (labelled DEFAULTS_FOR_CLASS in istiod's namespace); `data` holds the overlays by object kind."""

    meta: Meta
    data: tuple[tuple[str, str], ...] = ()
    defaults_for_class: str = ""  # the label's value: the class whose Gateways take these overlays
    created: str = ""  # creationTimestamp: of several defaults for one class, the oldest applies


DEFAULTS_FOR_CLASS = "gateway.istio.io/defaults-for-class"


@dataclass(frozen=True, slots=True)
class BackendTLSPolicy:
    """TLS from the proxies to a backend (gateway.networking.k8s.io/v1): the Services (or their named
    ports) it targets are called over TLS with SNI `hostname`, their certificate verified by the CA of
    a ConfigMap (`ca.crt`) or the system's, for `hostname` or the subjectAltNames."""

    meta: Meta
    targets: tuple[ParentRef, ...]  # group, kind, name, section_name (a port's name); namespace the policy's
    ca_refs: tuple[ObjectRef, ...] = ()
    well_known: str = ""  # wellKnownCACertificates (`System`)
    hostname: str = ""
    subject_alt_names: tuple[str, ...] = ()  # Hostname and URI values, in order
    generation: int = 0
    created: str = ""
    ignored: bool = False  # annotated istio.io/ignore-policy-attachment=true: left to another implementation


IGNORE_POLICY_ATTACHMENT = "istio.io/ignore-policy-attachment"
EXPERIMENTAL_GROUP = "gateway.networking.x-k8s.io"  # the experimental channel's X kinds


@dataclass(frozen=True, slots=True)
class BackendTrafficPolicy:
    """XBackendTrafficPolicy (gateway.networking.x-k8s.io/v1alpha1): a retry budget for calls to the
    Services it targets, with the Gateway API's defaults filled in as istiod fills them."""

    meta: Meta
    targets: tuple[ParentRef, ...]  # group, kind, name; namespace the policy's
    retry_budget: RetryBudget | None = None  # retryConstraint
    unsupported: tuple[str, ...] = ()  # fields set that istiod does not implement (sessionPersistence)
    generation: int = 0
    created: str = ""
    ignored: bool = False  # istio.io/ignore-policy-attachment=true


@dataclass(frozen=True, slots=True)
class GatewayClass:
    meta: Meta  # cluster-scoped: no namespace
    controller_name: str
    generation: int = 0
    labels: Labels = ()  # istio.io/waypoint-for: the default of its waypoints


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """A reference to another object: a listener's certificateRef, a route's backendRef (with port
    and weight), a ReferenceGrant's `to` (no namespace)."""

    group: str
    kind: str
    name: str
    namespace: str = ""  # "": the referring object's
    port: int = 0
    weight: int = 1
    headers: Headers = Headers()  # a backendRef's own RequestHeaderModifier / ResponseHeaderModifier filters


@dataclass(frozen=True, slots=True)
class ParentRef:
    name: str
    namespace: str = ""  # "": the route's
    group: str = GROUP
    kind: str = "Gateway"
    section_name: str = ""
    port: int = 0

    def as_dict(self) -> dict[str, object]:
        """As written back in a route's status.parents[].parentRef (defaults spelled out, as Istio)."""
        ref: dict[str, object] = {"group": self.group, "kind": self.kind, "name": self.name}
        if self.namespace:
            ref["namespace"] = self.namespace
        if self.section_name:
            ref["sectionName"] = self.section_name
        if self.port:
            ref["port"] = self.port
        return ref


@dataclass(frozen=True, slots=True)
class Listener:
    name: str
    port: int
    protocol: str  # HTTP, HTTPS, TLS, TCP, UDP, or a domain-prefixed custom protocol
    hostname: str = ""  # "": every host
    tls_mode: str = ""  # Terminate or Passthrough, with tls set
    certificate_refs: tuple[ObjectRef, ...] = ()
    tls_options: tuple[tuple[str, str], ...] = ()  # tls.options (key, value), by key
    from_namespaces: str = "Same"  # Same, All or Selector
    namespace_selector: Selector = Selector()  # allowedRoutes.namespaces.selector, with from: Selector
    kinds: tuple[tuple[str, str], ...] = ()  # (group, kind); empty: those of the protocol


@dataclass(frozen=True, slots=True)
class FrontendValidation:
    """spec.tls.frontend's `validation` of a port (or the default): the CA verifying clients."""
    ca_certificate_refs: tuple[ObjectRef, ...]
    mode: str = "AllowValidOnly"  # or AllowInsecureFallback


@dataclass(frozen=True, slots=True)
class KubernetesGateway:
    meta: Meta
    class_name: str
    listeners: tuple[Listener, ...]
    addresses: tuple[tuple[str, str], ...] = ()  # (type, value)
    generation: int = 0
    parameters_ref: ObjectRef | None = None  # spec.infrastructure.parametersRef: a ConfigMap of overlays
    labels: Labels = ()  # istio.io/waypoint-for on a waypoint
    frontend_default: FrontendValidation | None = None  # spec.tls.frontend.default.validation
    frontend_per_port: tuple[tuple[int, FrontendValidation | None], ...] = ()  # spec.tls.frontend.perPort
    name_override: str = ""  # annotation gateway.istio.io/name-override: its Deployment's and Service's name
    service_account: str = ""  # annotation gateway.istio.io/service-account: its ServiceAccount's name

    @property
    def deployment_name(self) -> str:
        """istiod's DeploymentName: the name-override annotation, else `<name>-<class>`, a waypoint's
        its own name (its class disables the suffix)."""
        return self.name_override or (self.meta.name if self.class_name == WAYPOINT_CLASS
                                      else f"{self.meta.name}-{self.class_name}")

    @property
    def managed(self) -> bool:
        """istiod's IsManaged: deployed by istiod unless spec.addresses names where it runs (one
        IPAddress is still deployed, as the Service's loadBalancerIP)."""
        return not self.addresses or (len(self.addresses) == 1 and self.addresses[0][0] == "IPAddress")

    def service_key(self, domain: str) -> tuple[str, str] | None:
        """(namespace, name) of the Service whose pods run the Gateway (istiod's extractGatewayServices):
        its deployment's, else the first Hostname address's (a short name is of the Gateway's
        namespace; `<name>.<ns>.svc.<domain>` of that namespace); None when no address names one."""
        if self.managed:
            return self.meta.namespace, self.deployment_name
        for kind, value in self.addresses:
            if kind != "Hostname":
                continue
            if "." not in value:
                return self.meta.namespace, value
            name, _, rest = value.partition(".")
            namespace, _, suffix = rest.partition(".")
            if suffix == f"svc.{domain}":
                return namespace, name
        return None

    def frontend_validation(self, port: int) -> FrontendValidation | None:
        """istiod's resolveGatewayTLS: the port's own entry (even without validation), else the default."""
        return dict(self.frontend_per_port).get(port, self.frontend_default)


@dataclass(frozen=True, slots=True)
class PathModifier:
    type: str  # ReplaceFullPath or ReplacePrefixMatch
    value: str


@dataclass(frozen=True, slots=True)
class RequestRedirect:
    scheme: str = ""
    hostname: str = ""
    path: PathModifier | None = None
    port: int = 0
    status_code: int = 302


@dataclass(frozen=True, slots=True)
class URLRewrite:
    hostname: str = ""
    path: PathModifier | None = None


@dataclass(frozen=True, slots=True)
class RouteFilter:
    """One of a rule's filters: `type` names which of the other fields is set. Types we do not
    translate keep only their type, so status can name them."""

    type: str
    request_headers: HeaderOperations | None = None
    response_headers: HeaderOperations | None = None
    redirect: RequestRedirect | None = None
    rewrite: URLRewrite | None = None
    mirror: ObjectRef | None = None
    cors: CorsPolicy | None = None


@dataclass(frozen=True, slots=True)
class RouteMatch:
    path: StringMatch | None = None
    headers: tuple[tuple[str, StringMatch], ...] = ()
    query_params: tuple[tuple[str, StringMatch], ...] = ()
    method: str = ""


@dataclass(frozen=True, slots=True)
class RouteRule:
    matches: tuple[RouteMatch, ...] = ()  # empty: prefix `/`
    filters: tuple[RouteFilter, ...] = ()
    backend_refs: tuple[ObjectRef, ...] = ()
    request_timeout: Duration | None = None
    backend_timeout: Duration | None = None
    retry: Retries | None = None
    # (reason, message) of what makes the rule untranslatable (an RE2 pattern Envoy would refuse, a
    # filter or field not implemented): it answers 500 and the route's status says why.
    errors: tuple[tuple[str, str], ...] = ()
    unmatchable: bool = False  # a match Envoy would refuse: the rule is left out entirely


@dataclass(frozen=True, slots=True)
class KubernetesHTTPRoute:
    meta: Meta
    parent_refs: tuple[ParentRef, ...]
    hostnames: tuple[str, ...] = ()
    rules: tuple[RouteRule, ...] = ()
    created: str = ""  # metadata.creationTimestamp: the older route wins ties, as the spec orders
    generation: int = 0
    # or GRPCRoute; or TCPRoute or TLSRoute, whose rules have backendRefs only (L4_ROUTE_KINDS)
    kind: str = "HTTPRoute"


@dataclass(frozen=True, slots=True)
class ReferenceGrant:
    meta: Meta
    from_: tuple[tuple[str, str, str], ...]  # (group, kind, namespace)
    to: tuple[ObjectRef, ...]  # group, kind and optional name

    def permits(self, group: str, kind: str, namespace: str, to_group: str, to_kind: str, to_name: str) -> bool:
        return ((group, kind, namespace) in self.from_
                and any(t.group == to_group and t.kind == to_kind and t.name in ("", to_name) for t in self.to))


@dataclass(frozen=True, slots=True)
class Waypoint:
    """A programmed waypoint Gateway (class of the mesh controller), as ztunnel is told of it: its
    status address (its Service's hostname), the traffic it takes (`istio.io/waypoint-for`:
    service, workload, all or none) and the namespaces its HBONE listener admits."""

    meta: Meta
    hostname: str
    traffic: str = "service"
    from_namespaces: str = "Same"
    namespace_selector: Selector = Selector()

    def admits(self, namespace: str, namespace_labels: Mapping[str, str]) -> bool:
        if self.from_namespaces == "All":
            return True
        if self.from_namespaces == "Selector":
            return self.namespace_selector.matches(namespace_labels)
        return namespace == self.meta.namespace


StatusKey = tuple[str, str, str]  # (store kind, namespace, name)


@dataclass(frozen=True, slots=True)
class GatewayApiConfig:
    """The Istio config the Gateway API objects make, and the status each object should have."""

    gateways: tuple[Gateway, ...] = ()
    virtual_services: tuple[VirtualService, ...] = ()
    statuses: Mapping[StatusKey, dict[str, Any]] = field(default_factory=dict)
    missing_classes: tuple[str, ...] = ()  # builtin GatewayClasses (`istio`, `istio-waypoint`) istiod creates
    # GAMMA: routes on a Service parent, bound to `mesh` for that Service's host.
    mesh_virtual_services: tuple[VirtualService, ...] = ()
    waypoints: Mapping[tuple[str, str], Waypoint] = field(default_factory=dict)  # by (namespace, name)
    # BackendTLSPolicies: a DestinationRule for each Service they target, as istiod makes them.
    destination_rules: tuple[DestinationRule, ...] = ()

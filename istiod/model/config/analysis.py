"""Istio's config analyzers (istioctl analyze, and istiod's status analysis): their codes, levels and
message texts, over the objects as written. Pure: resources in, messages out.

Each analyzer names the kinds it reads; as Istio's, one that needs a Kubernetes kind is skipped
when those are not read (files alone: `istioctl analyze --use-kube=false` reads no Service, Pod or
Namespace, so it never reports a missing host or a selector that matches no pod)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from istiod.model.config import envoyfilter
from istiod.model.config.annotations import ANNOTATIONS
from istiod.model.config.gateway_conversion import GATEWAY_NAME_LABEL
from istiod.model.config.networking import routing_claim
from istiod.model.protocol import Protocol, port_protocol
from istiod.model.service import Port

ERROR, WARNING, INFO = "Error", "Warning", "Info"
_LEVEL_ORDER = {ERROR: 0, WARNING: 1, INFO: 2}

# Code -> (level, template): Istio's pkg/config/analysis/msg/messages.yaml, for the codes produced here.
MESSAGES: dict[str, tuple[str, str]] = {
    "IST0002": (WARNING, "Deprecated: {}"),
    "IST0101": (ERROR, "Referenced {} not found: {}"),
    "IST0102": (INFO, "The namespace is not enabled for Istio injection. Run 'kubectl label namespace {} "
                      "istio-injection=enabled' to enable it, or 'kubectl label namespace {} istio-injection=disabled' "
                      "to explicitly mark it as not needing injection."),
    "IST0103": (WARNING, "The pod {} is missing the Istio proxy. This can often be resolved by restarting or "
                         "redeploying the workload."),
    "IST0106": (ERROR, "Schema validation error: {}"),
    "IST0109": (ERROR, "The VirtualServices {} associated with mesh gateway define the same host {} which can lead to "
                       "undefined behavior. This can be fixed by merging the conflicting VirtualServices into a single "
                       "resource."),
    "IST0110": (ERROR, "The Sidecars {} in namespace {} select the same workload pod {}, which can lead to undefined "
                       "behavior."),
    "IST0111": (ERROR, "The Sidecars {} in namespace {} have no workload selector, which can lead to undefined "
                       "behavior."),
    "IST0112": (ERROR, "This VirtualService routes to a service {} that exposes multiple ports {}. Specifying a port in "
                       "the destination is required to disambiguate."),
    "IST0116": (WARNING, "This deployment {} is associated with multiple services using port {} but different protocols: "
                         "{}"),
    "IST0118": (INFO, "Port name {} (port: {}, targetPort: {}) doesn't follow the naming convention of Istio port."),
    "IST0123": (WARNING, "The namespace has more than one type of injection labels {}, which may lead to undefined "
                         "behavior. Make sure only one injection label exists."),
    "IST0127": (WARNING, "No matching workloads for this resource with the following labels: {}"),
    "IST0128": (WARNING, "DestinationRule {} in namespace {} has TLS mode set to {} but no caCertificates are set to "
                         "validate server identity for host: {}"),
    "IST0129": (WARNING, "DestinationRule {} in namespace {} has TLS mode set to {} but no caCertificates are set to "
                         "validate server identity for host: {} at port {}"),
    "IST0130": (WARNING, "VirtualService rule {} not used ({})."),
    "IST0131": (INFO, "VirtualService rule {} match {} is not used (duplicate/overlapping match in rule {})."),
    "IST0132": (WARNING, "one or more host {} defined in VirtualService {} not found in Gateway {}."),
    "IST0134": (WARNING, "ServiceEntry addresses are required for this protocol."),
    "IST0138": (WARNING, "Duplicate certificate in multiple gateways {} may cause 404s if clients re-use HTTP2 "
                         "connections."),
    "IST0140": (WARNING, "Subset in virtual service {} has no effect on ingress gateway {} requests"),
    "IST0145": (ERROR, "Conflict with gateways {} (workload selector {}, port {}, hosts {})."),
    "IST0148": (INFO, "is enabled for Istio injection, as Istio is installed with enableNamespacesByDefault as true."),
    "IST0150": (WARNING, "Port name for ExternalName service is invalid. Proxy may prevent tcp named ports and unmatched "
                         "traffic for ports serving TCP protocol from being forwarded correctly"),
    "IST0161": (ERROR, "The credential referenced by the Gateway {} in namespace {} is invalid, which can cause the "
                       "traffic not to work as expected."),
    "IST0162": (WARNING, "The gateway is listening on a target port (port {}) that is not defined in the Service "
                         "associated with its workload instances (Pod selector {}). If you need to access the gateway "
                         "port through the gateway Service, it will not be available."),
    "IST0137": (WARNING, "This deployment {} is associated with multiple services {} using targetPort {} but different "
                         "ports: {}."),
    "IST0144": (WARNING, "User ID (UID) 1337 is reserved for the sidecar proxy."),
    "IST0149": (ERROR, "The virtual service uses the JWT claim based routing (key: {}) but found no request authentication "
                       "for the gateway ({}) pod ({}). The request authentication must first be applied for the gateway "
                       "pods to validate the JWT token and make the claims available for routing."),
    "IST0166": (WARNING, "Ineffective selector on Kubernetes Gateway {}. Use the TargetRef field instead."),
    "IST0171": (WARNING, "A condition with a negative status is present: type={}, reason={}, message={}."),
    "IST0177": (WARNING, "Multiple ServiceEntries ({}) define the same host {} and port {} with conflicting protocols "
                         "({})."),
    "IST0173": (ERROR, "The Subset {} defined in the DestinationRule does not select any pods. Which may lead to 503 UH "
                       "(NoHealthyUpstream)."),
    "IST0107": (WARNING, "Misplaced annotation: {} can only be applied to {}"),
    "IST0108": (WARNING, "Unknown annotation: {}"),
    "IST0125": (WARNING, "Invalid annotation {}: {}"),
    "IST0135": (INFO, "Annotation {} has been deprecated{} and may not work in future Istio versions."),
    "IST0174": (WARNING, "The host {} defined in the DestinationRule does not match any services in the mesh."),
    "IST0151": (WARNING, "This EnvoyFilter does not have a priority and has a relative patch operation set which can "
                         "cause the EnvoyFilter not to be applied. Using the INSERT_FIRST of ADD option or setting the "
                         "priority may help in ensuring the EnvoyFilter is applied correctly."),
    "IST0133": (WARNING, "Schema validation warning: {}"),
    "IST0152": (ERROR, "The REPLACE operation is only valid for HTTP_FILTER and NETWORK_FILTER."),
    "IST0153": (ERROR, "The ADD operation will be ignored when applyTo is set to ROUTE_CONFIGURATION, or HTTP_ROUTE."),
    "IST0154": (ERROR, "The REMOVE operation will be ignored when applyTo is set to ROUTE_CONFIGURATION, or HTTP_ROUTE."),
    "IST0155": (WARNING, "This EnvoyFilter does not have a priority and has a relative patch operation (NSTERT_BEFORE/AFTER, "
                         "REPLACE, MERGE, DELETE) and proxyVersion set which can cause the EnvoyFilter not to be applied "
                         "during an upgrade. Using the INSERT_FIRST or ADD option or setting the priority may help in "
                         "ensuring the EnvoyFilter is applied correctly."),
}

# The Kubernetes kinds analyzers read besides Istio's; only a cluster provides them.
KUBE_KINDS = ("Namespace", "Service", "Pod", "Node", "ConfigMap", "Secret", "Deployment")
# Namespaces Istio never analyzes (its injector's ignored namespaces).
IGNORED_NAMESPACES = frozenset({"kube-system", "kube-public", "kube-node-lease", "local-path-storage"})
SUPPRESS_ANNOTATION = "galley.istio.io/analyze-suppress"
_DOMAIN = "svc.cluster.local"  # Istio's analyzers assume it, whatever the cluster's
_ISTIO_NAMESPACE = "istio-system"
_WELL_KNOWN_TCP_PORTS = frozenset({25, 53, 3306})  # SMTP, DNS, MySQL: TCP when the name says nothing


def go_quote(value: str) -> str:
    """Go's %q for the strings config holds."""
    return json.dumps(value, ensure_ascii=False)


def go_list(values: Iterable[Any]) -> str:
    """Go's %v of a slice."""
    return "[" + " ".join(str(v) for v in values) + "]"


@dataclass(frozen=True, slots=True)
class Resource:
    """One object as read (file or cluster): what the analyzers see of it."""

    kind: str
    namespace: str  # "" for cluster-scoped kinds
    name: str
    body: Mapping[str, Any] = field(compare=False)
    reference: str = field(default="", compare=False)  # `file:line` when read from a file
    # The line of each scalar field, keyed as Istio's analyzers name them (`{.spec.gateways[0]}`).
    fields: Mapping[str, int] = field(default_factory=dict, compare=False)

    @property
    def spec(self) -> Mapping[str, Any]:
        return self.body.get("spec") or {}

    @property
    def labels(self) -> Mapping[str, str]:
        return (self.body.get("metadata") or {}).get("labels") or {}

    @property
    def annotations(self) -> Mapping[str, str]:
        return (self.body.get("metadata") or {}).get("annotations") or {}

    @property
    def full_name(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name

    @property
    def origin(self) -> str:
        return f"{self.kind} {self.full_name}"

    @property
    def origin_namespace(self) -> str:
        return self.name if self.kind == "Namespace" else self.namespace


@dataclass(frozen=True, slots=True)
class Message:
    code: str
    resource: Resource
    parameters: tuple[Any, ...] = ()
    path: str = ""  # the field at fault: its line replaces the object's in the reference

    @property
    def reference(self) -> str:
        reference, line = self.resource.reference, self.resource.fields.get(self.path)
        head, colon, tail = reference.rpartition(":")
        return f"{head}:{line}" if line and colon and tail.isdigit() else reference

    @property
    def level(self) -> str:
        return MESSAGES[self.code][0]

    @property
    def text(self) -> str:
        return MESSAGES[self.code][1].format(*self.parameters)

    @property
    def origin(self) -> str:
        return self.resource.origin

    def line(self) -> str:
        reference = f" {self.reference}" if self.reference else ""
        return f"{self.level} [{self.code}] ({self.origin}{reference}) {self.text}"

    def json(self) -> dict[str, str]:
        """istioctl analyze -o json's fields."""
        found = {"code": self.code, "documentationUrl": documentation_url(self.code, "istioctl-analyze"),
                 "level": self.level,
                 "message": self.text, "origin": self.origin}
        if self.reference:
            found["reference"] = self.reference
        return found

    def sort_key(self) -> tuple[int, str, str, str]:
        """Istio's order: level, code, then kind/name/namespace, then the line."""
        r = self.resource
        return _LEVEL_ORDER[self.level], self.code, f"{r.kind}/{r.name}/{r.namespace}", self.line()


# The Istio release whose analyzers these match: its documentation explains the codes.
DOCS = "https://istio.io/v1.31/docs/reference/config/analysis"


def documentation_url(code: str, ref: str = "") -> str:
    """Istio's link for a code; `ref` names who links (istioctl analyze's `?ref=istioctl-analyze`)."""
    return f"{DOCS}/{code.lower()}/" + (f"?ref={ref}" if ref else "")


def schema_error(resource: Resource, error: str) -> Message:
    return Message("IST0106", resource, (error,))


class Objects:
    """The objects one analysis reads, by kind."""

    def __init__(self, resources: Iterable[Resource], kinds: Iterable[str]) -> None:
        self.kinds = frozenset(kinds)  # what was read at all: an analyzer needing another kind is skipped
        self._by_kind: dict[str, list[Resource]] = defaultdict(list)
        self._by_name: dict[tuple[str, str, str], Resource] = {}
        self._index: dict[str, Any] = {}  # built on first use
        for resource in resources:
            self._by_kind[resource.kind].append(resource)
            self._by_name[(resource.kind, resource.namespace, resource.name)] = resource

    def __call__(self, kind: str) -> list[Resource]:
        return self._by_kind.get(kind, [])

    def _selected_ids(self, selector: Mapping[str, str]) -> frozenset[int]:
        if "pods" not in self._index:
            by_label: dict[tuple[str, str], list[int]] = defaultdict(list)
            for i, pod in enumerate(self("Pod")):
                for label in pod.labels.items():
                    by_label[label].append(i)
            self._index["pods"] = {label: frozenset(ids) for label, ids in by_label.items()}
        if not selector:
            return frozenset(range(len(self("Pod"))))
        index: dict[tuple[str, str], frozenset[int]] = self._index["pods"]
        return frozenset.intersection(*(index.get(label, frozenset()) for label in selector.items()))

    def selected(self, selector: Mapping[str, str]) -> list[Resource]:
        """The pods whose labels hold every label of `selector` (all pods for an empty one), in order."""
        pods = self("Pod")
        return [pods[i] for i in sorted(self._selected_ids(selector))]

    def any_selected(self, selector: Mapping[str, str]) -> bool:
        return bool(self._selected_ids(selector))

    def get(self, kind: str, namespace: str, name: str) -> Resource | None:
        return self._by_name.get((kind, namespace, name))

    def exists(self, kind: str, namespace: str, name: str) -> bool:
        return (kind, namespace, name) in self._by_name


Analyzer = Callable[[Objects], Iterator[Message]]
_ANALYZERS: list[tuple[tuple[str, ...], Analyzer]] = []


def _analyzer(*inputs: str) -> Callable[[Analyzer], Analyzer]:
    def register(function: Analyzer) -> Analyzer:
        _ANALYZERS.append((inputs, function))
        return function
    return register


def analyze(objects: Objects) -> list[Message]:
    """Every analyzer whose kinds were read; messages deduplicated, in Istio's order."""
    found: dict[str, Message] = {}
    for inputs, analyzer in _ANALYZERS:
        if all(kind in objects.kinds for kind in inputs):
            for message in analyzer(objects):
                found.setdefault(message.line(), message)
    return sorted(found.values(), key=Message.sort_key)


def selected(messages: Iterable[Message], namespace: str | None) -> list[Message]:
    """Messages of `namespace` (None: all), minus those the resource's annotation suppresses."""
    kept = []
    for message in messages:
        if namespace is not None and message.resource.origin_namespace not in ("", namespace):
            continue
        codes = message.resource.annotations.get(SUPPRESS_ANNOTATION, "")
        if codes and any(code in ("*", message.code) for code in codes.split(",")):
            continue
        kept.append(message)
    return kept


# --- host names, as Istio's analyzers treat them (util/hosts.go, util/service_lookup.go) ---

def _fqdn(namespace: str, host: str) -> str:
    return host if host.startswith("*") or "." in host else f"{host}.{namespace}.{_DOMAIN}"


def _resource_name(namespace: str, host: str) -> tuple[str, str]:
    """(namespace, name) a host stands for: from `name.ns.svc.cluster.local`, else the host in `namespace`."""
    if host.endswith("." + _DOMAIN):
        name, _, ns = host.removesuffix("." + _DOMAIN).rpartition(".")
        if name and ns:
            return ns, name
    return namespace, host


_Scoped = tuple[str, str]  # (exportTo scope, fqdn)


def _service_entry_hosts(objects: Objects) -> dict[_Scoped, Mapping[str, Any]]:
    """Every host ServiceEntries and Services declare, by the scope it is exported to, to its
    ServiceEntry spec (Services as one with their ports)."""
    hosts: dict[_Scoped, Mapping[str, Any]] = {}
    for entry in objects("ServiceEntry"):
        export_to = entry.spec.get("exportTo") or []
        for host in entry.spec.get("hosts") or []:
            scopes = ["*"] if not export_to or "*" in export_to else [
                entry.namespace if e == "." else e for e in export_to]
            for scope in scopes:
                hosts[(scope, _fqdn(entry.namespace, host))] = entry.spec
    for service in objects("Service"):
        spec = {"hosts": [_fqdn(service.namespace, service.name)],
                "ports": [{"number": p.get("port"), "name": p.get("name", ""), "protocol": p.get("protocol", "")}
                          for p in service.spec.get("ports") or []]}
        annotation = service.annotations.get("networking.istio.io/exportTo", "")
        scopes = ["*"] if not annotation else [
            service.namespace if s.strip() == "." else s.strip() for s in annotation.split(",")]
        for scope in scopes:
            hosts[(scope, _fqdn(service.namespace, service.name))] = spec
    return hosts


def _destination_host(namespace: str, export_to: Sequence[str], host: str,
                      hosts: Mapping[_Scoped, Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """util.GetDestinationHost: the ServiceEntry (or Service) a destination host names, as seen
    from `namespace`."""
    fqdn = _fqdn(namespace, host)
    if ("*", fqdn) in hosts:
        return hosts[("*", fqdn)]
    for scope in [namespace] if not export_to else [namespace if e == "." else e for e in export_to]:
        if (scope, fqdn) in hosts:
            return hosts[(scope, fqdn)]
    for (scope, entry_host), spec in hosts.items():
        if entry_host.startswith("*") and scope in ("*", namespace) and \
                host.removeprefix("*").endswith(entry_host.removeprefix("*")):
            return spec
    return None


def _host_matches(a: str, b: str) -> bool:
    """host.Name.Matches: either side may be a wildcard."""
    if a.startswith("*") and b.startswith("*"):
        return b[1:].endswith(a[1:]) if len(a) < len(b) else a[1:].endswith(b[1:])
    if a.startswith("*"):
        return b.endswith(a[1:])
    if b.startswith("*"):
        return a.endswith(b[1:])
    return a == b


_NAME = "{.metadata.name}"


def _selector_path(selector: Mapping[str, str]) -> str:
    """A Gateway selector's first label (in the selector's string order), where Istio points."""
    return f"{{.spec.selector.{_selector(selector).partition('=')[0]}}}"


def _selector(labels: Mapping[str, str]) -> str:
    """labels.SelectorFromSet(...).String(): sorted `k=v`, comma-joined."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- annotations ---

# Set by istiod, its gateway controller or the injector: never reported (maturity.AlwaysIgnoredAnnotations).
_IGNORED_ANNOTATIONS = frozenset({"sidecar.istio.io/status", "gateway.istio.io/controller-version", "istio.io/rev"})
_DEPRECATION_EXTRA = {"sidecar.istio.io/inject": ' in favor of the "sidecar.istio.io/inject" label'}


@_analyzer("Namespace", "Service", "Pod", "Deployment")
def _annotations(objects: Objects) -> Iterator[Message]:
    """annotations.K8sAnalyzer: IST0108, IST0135, IST0107, IST0125 (for the annotations
    _ANNOTATION_CHECKS covers)."""
    for kind in ("Namespace", "Service", "Pod", "Deployment"):
        for resource in objects(kind):
            for name in resource.annotations:
                if not _istio_annotation(name) or name in _IGNORED_ANNOTATIONS:
                    continue
                known = ANNOTATIONS.get(name)
                if known is None:
                    yield Message("IST0108", resource, (name,))
                    continue
                if known.deprecated and not (name == "sidecar.istio.io/inject" and name in resource.labels):
                    yield Message("IST0135", resource, (go_quote(name), _DEPRECATION_EXTRA.get(name, "")))
                if "Any" not in known.resources and kind not in known.resources:
                    yield Message("IST0107", resource, (name, ", ".join(known.resources)))
                elif (check := _ANNOTATION_CHECKS.get(name)) and (error := check(resource.annotations[name])):
                    yield Message("IST0125", resource, (name, error))


def _parse_uint(value: str, bits: int) -> str | None:
    """Go's strconv.ParseUint(value, 10, bits) error, None when it parses."""
    if not value or not value.isascii() or not value.isdigit():
        return f"strconv.ParseUint: parsing {go_quote(value)}: invalid syntax"
    if int(value) >= 1 << bits:
        return f"strconv.ParseUint: parsing {go_quote(value)}: value out of range"
    return None


def _parse_port(value: str) -> str | None:
    error = _parse_uint(value.strip(), 16)
    return f"failed parsing port '{value}': {error}" if error else None


def _port_list(parameter: str) -> Callable[[str], str | None]:
    """inject's validatePortList; includeInboundPorts also takes `*`."""
    def check(value: str) -> str | None:
        if parameter == "includeInboundPorts" and value == "*":
            return None
        for port in value.strip().split(",") if value.strip() else []:
            if error := _parse_port(port):
                return f"{parameter} invalid: failed parsing port '{port}': {error}"
        return None
    return check


def _status_port(value: str) -> str | None:
    error = _parse_port(value)
    return f"excludeInboundPorts invalid: {error}" if error else None  # sic, Istio's text


def _bool(value: str) -> str | None:
    ok = value in ("1", "t", "T", "TRUE", "true", "True", "0", "f", "F", "FALSE", "false", "False")
    return None if ok else f"strconv.ParseBool: parsing {go_quote(value)}: invalid syntax"


_INTERFACE_NAME = re.compile(r"[a-zA-Z][a-zA-Z0-9_.\-]*")


def _interfaces(value: str) -> str | None:
    """netutil.ValidateInterfaceNames."""
    for name in value.split(",") if value else []:
        name = name.strip()
        if not name:
            return "empty interface name"
        if len(name.encode()) > 15:
            return f"interface name {go_quote(name)} too long (max 15 chars)"
        if not _INTERFACE_NAME.fullmatch(name):
            return f"interface name {go_quote(name)} contains invalid characters"
    return None


def _interception_mode(value: str) -> str | None:
    ok = value in ("REDIRECT", "TPROXY", "NONE")
    return None if ok else f"interceptionMode invalid, use REDIRECT,TPROXY,NONE: {value}"


# The injector's value checks (inject.AnnotationValidation) for the annotations whose checks are plain
# parsing; the IP-range, resource-quantity and proxy.istio.io/config checks are not made.
_ANNOTATION_CHECKS: dict[str, Callable[[str], str | None]] = {
    "sidecar.istio.io/interceptionMode": _interception_mode,
    "status.sidecar.istio.io/port": _status_port,
    "readiness.status.sidecar.istio.io/initialDelaySeconds": lambda v: _parse_uint(v, 32),
    "readiness.status.sidecar.istio.io/periodSeconds": lambda v: _parse_uint(v, 32),
    "readiness.status.sidecar.istio.io/failureThreshold": lambda v: _parse_uint(v, 32),
    "traffic.sidecar.istio.io/includeInboundPorts": _port_list("includeInboundPorts"),
    "traffic.sidecar.istio.io/excludeInboundPorts": _port_list("excludeInboundPorts"),
    "traffic.sidecar.istio.io/excludeOutboundPorts": _port_list("excludeOutboundPorts"),
    "traffic.sidecar.istio.io/excludeInterfaces": _interfaces,
    "traffic.sidecar.istio.io/kubevirtInterfaces": _interfaces,
    "istio.io/reroute-virtual-interfaces": _interfaces,
    "prometheus.istio.io/merge-metrics": _bool,
}


def _istio_annotation(name: str) -> bool:
    return name == "kubernetes.io/ingress.class" or name.split("/")[0].endswith("istio.io")


# --- VirtualService ---

@dataclass(frozen=True, slots=True)
class _Destination:
    path: str  # its host field, as Istio's analyzers name it
    destination: Mapping[str, Any]


def _route_destinations(spec: Mapping[str, Any]) -> list[_Destination]:
    return [_Destination(f"{{.spec.{kind}[{i}].route[{j}].destination.host}}", route.get("destination") or {})
            for kind in ("tcp", "tls", "http") for i, rule in enumerate(spec.get(kind) or [])
            for j, route in enumerate(rule.get("route") or [])]


def _mirror_destinations(spec: Mapping[str, Any]) -> list[_Destination]:
    found = []
    for i, rule in enumerate(spec.get("http") or []):
        if rule.get("mirror"):
            found.append(_Destination(f"{{.spec.http[{i}].mirror.host}}", rule["mirror"]))
        found += [_Destination(f"{{.spec.http[{i}].mirrors[{j}].host}}", m.get("destination") or {})
                  for j, m in enumerate(rule.get("mirrors") or [])]
    return found


@_analyzer("Gateway", "VirtualService")
def _virtual_service_gateways(objects: Objects) -> Iterator[Message]:
    """virtualservice.GatewayAnalyzer: IST0101 (gateway), IST0132."""
    for vs in objects("VirtualService"):
        for i, gateway in enumerate(vs.spec.get("gateways") or []):
            if gateway == "mesh":
                continue
            namespace, _, name = gateway.rpartition("/")
            namespace = namespace or vs.namespace
            path = f"{{.spec.gateways[{i}]}}"
            if not objects.exists("Gateway", namespace, name):
                yield Message("IST0101", vs, ("gateway", go_quote(gateway)), path)
            if not _host_in_gateway(objects, namespace, name, vs.spec.get("hosts") or [], vs.namespace):
                yield Message("IST0132", vs, (go_list(vs.spec.get("hosts") or []), vs.full_name, f"{namespace}/{name}"),
                              path)


def _host_in_gateway(objects: Objects, namespace: str, name: str, vs_hosts: Sequence[str], vs_namespace: str) -> bool:
    gateway_hosts: list[str] = []
    gateway = objects.get("Gateway", namespace, name)
    for server in gateway.spec.get("servers") or [] if gateway is not None else []:
        gateway_hosts += _server_hosts(server.get("hosts") or [], namespace)
    names = []
    for host in gateway_hosts:
        ns, slash, bare = host.partition("/")
        if slash and ns not in (vs_namespace, "*"):
            continue
        names.append(bare if slash else host)
    return any(_host_matches(g, h) for g in names for h in vs_hosts)


def _server_hosts(hosts: Sequence[str], namespace: str) -> list[str]:
    """sanitizeServerHostNamespace: `./h` is the gateway's namespace, `*/h` any; `*/*` all hosts."""
    result = []
    for host in hosts:
        ns, slash, bare = host.partition("/")
        if slash and ns == "." :
            result.append(f"{namespace}/{bare}")
        elif slash and ns == "*":
            if bare == "*":
                return ["*"]
            result.append(bare)
        else:
            result.append(host)
    return result


@_analyzer("VirtualService")
def _unreachable_rules(objects: Objects) -> Iterator[Message]:
    """Istio's VirtualService validation warnings: IST0130, IST0131 (exact duplicates; the
    overlapping-prefix check is not made)."""
    for vs in objects("VirtualService"):
        for kind in ("http", "tcp", "tls"):
            yield from _unreachable(vs, kind, vs.spec.get(kind) or [])


def _unreachable(vs: Resource, kind: str, rules: Sequence[Mapping[str, Any]]) -> Iterator[Message]:
    def name(rule: Mapping[str, Any], n: int) -> str:
        return go_quote(rule["name"]) if kind == "http" and rule.get("name") else f"#{n}"

    seen: dict[str, int] = {}
    empty = -1
    for n, rule in enumerate(rules):
        matches = rule.get("match") or []
        if not matches:
            if empty >= 0:
                yield Message("IST0130", vs, (name(rule, n), "only the last rule can have no matches"))
            empty = n
            continue
        duplicates = 0
        for m, match in enumerate(matches):
            if empty >= 0:
                yield Message("IST0130", vs, (name(rule, n), "route without matches defined before"))
                continue
            text = json.dumps(match, sort_keys=True)
            if text in seen:
                match_name = go_quote(match["name"]) if kind == "http" and match.get("name") else f"#{m}"
                yield Message("IST0131", vs, (name(rule, n), match_name, name(rules[seen[text]], seen[text])))
                duplicates += 1
                continue
            seen[text] = n
        if duplicates == len(matches):
            yield Message("IST0130", vs, (name(rule, n), "all matches used by prior rules"))


@_analyzer("VirtualService", "DestinationRule")
def _virtual_service_subsets(objects: Objects) -> Iterator[Message]:
    """virtualservice.DestinationRuleAnalyzer: IST0101 (host+subset, mirror+subset)."""
    subsets = {(_resource_name(dr.namespace, dr.spec.get("host", "")), s.get("name", ""))
               for dr in objects("DestinationRule") for s in dr.spec.get("subsets") or []}
    for vs in objects("VirtualService"):
        for reftype, destinations in (("host+subset in destinationrule", _route_destinations(vs.spec)),
                                      ("mirror+subset in destinationrule", _mirror_destinations(vs.spec))):
            for d in destinations:
                host, subset = d.destination.get("host", ""), d.destination.get("subset", "")
                if subset and (_resource_name(vs.namespace, host), subset) not in subsets:
                    yield Message("IST0101", vs, (reftype, go_quote(f"{host}+{subset}")), d.path)


@_analyzer("ServiceEntry", "VirtualService", "Service")
def _virtual_service_hosts(objects: Objects) -> Iterator[Message]:
    """virtualservice.DestinationHostAnalyzer: IST0101 (host, mirror host, host:port), IST0112, IST0140."""
    hosts = _service_entry_hosts(objects)
    with_subsets = {vs.full_name: [d for d in _route_destinations({"http": vs.spec.get("http")})
                                   if d.destination.get("subset") and d.destination.get("host") in (vs.spec.get("hosts") or [])]
                    for vs in objects("VirtualService")}
    for vs in objects("VirtualService"):
        if vs.spec.get("gateways"):
            for i, rule in enumerate(vs.spec.get("http") or []):
                for j, route in enumerate(rule.get("route") or []):
                    destination = route.get("destination") or {}
                    if destination.get("subset"):
                        continue
                    # Istio names the field with the rule's name where the others say `http` (so rarely finds it).
                    path = f"{{.spec.{rule.get('name', '')}[{i}].route[{j}].destination.host}}"
                    for other, destinations in with_subsets.items():
                        for _ in (x for x in destinations if x.destination.get("host") == destination.get("host")):
                            yield Message("IST0140", vs, (other, vs.full_name), path)
        export_to = vs.spec.get("exportTo") or []
        for reftype, destinations in (("host", _route_destinations(vs.spec)), ("mirror host", _mirror_destinations(vs.spec))):
            for d in destinations:
                host = d.destination.get("host", "")
                entry = _destination_host(vs.namespace, export_to, host, hosts)
                if entry is None:
                    yield Message("IST0101", vs, (reftype, go_quote(host)), d.path)
                    continue
                yield from _destination_ports(vs, d, entry)


def _destination_ports(vs: Resource, d: _Destination, entry: Mapping[str, Any]) -> Iterator[Message]:
    destination = d.destination
    ports = [p.get("number") for p in entry.get("ports") or []]
    port = (destination.get("port") or {}).get("number")
    if destination.get("port") is None:
        if len(ports) > 1:
            yield Message("IST0112", vs, (go_quote(destination.get("host", "")), go_list(ports)), d.path)
    elif port not in ports:
        yield Message("IST0101", vs, ("host:port", go_quote(f"{destination.get('host', '')}:{port or 0}")), d.path)


@_analyzer("VirtualService")
def _mesh_gateway_hosts(objects: Objects) -> Iterator[Message]:
    """virtualservice.ConflictingMeshGatewayHostsAnalyzer: IST0109."""
    by_host: dict[_Scoped, list[Resource]] = defaultdict(list)
    for vs in objects("VirtualService"):
        gateways = vs.spec.get("gateways") or []
        if gateways and "mesh" not in gateways:
            continue
        export_to = vs.spec.get("exportTo") or []
        scopes = ["*"] if not export_to or "*" in export_to else \
            list(dict.fromkeys(vs.namespace if e == "." else e for e in export_to))
        for scope in scopes:
            for host in vs.spec.get("hosts") or []:
                by_host[(scope, _fqdn(vs.namespace, host))].append(vs)
    reported = set()
    for (scope, host), same in by_host.items():
        if scope != "*":
            same = same + [vs for (s, h), more in by_host.items() if s == "*" and _host_matches(host, h) for vs in more]
        if len(same) > 1:
            names = ",".join(sorted(vs.full_name for vs in same))
            for vs in same:
                if vs.full_name not in reported:
                    reported.add(vs.full_name)
                    yield Message("IST0109", vs, (names, f"{scope}/{host}"), _NAME)


# --- ServiceEntry ---

@_analyzer("ServiceEntry")
def _service_entry_addresses(objects: Objects) -> Iterator[Message]:
    """serviceentry.ProtocolAddressesAnalyzer: IST0134 (addresses needed for a TCP port), unless the
    mesh config's proxyMetadata turns on DNS capture with auto-allocation (read from a cluster's
    ConfigMap `istio`; without one, Istio's defaults, which do not)."""
    if _auto_allocates(objects):
        return
    for entry in objects("ServiceEntry"):
        if entry.spec.get("addresses") or (entry.body.get("status") or {}).get("addresses"):
            continue
        for i, port in enumerate(entry.spec.get("ports") or []):
            if port.get("protocol", "").upper() in ("", "TCP"):
                yield Message("IST0134", entry, (), f"{{.spec.ports[{i}].name}}")


def _auto_allocates(objects: Objects) -> bool:
    default_config = _mesh_config(objects).get("defaultConfig")
    metadata = (default_config.get("proxyMetadata") if isinstance(default_config, dict) else None) or {}
    return bool(metadata.get("ISTIO_META_DNS_CAPTURE") == "true" and "true" in (
        metadata.get("ISTIO_META_DNS_AUTO_ALLOCATE"), metadata.get("PILOT_ENABLE_IP_AUTOALLOCATE")))


def _mesh_config(objects: Objects) -> Mapping[str, Any]:
    """The mesh config of a cluster's ConfigMap `istio` (key `mesh`); {} (Istio's defaults) without one."""
    for configmap in objects("ConfigMap"):
        if configmap.name == "istio" and configmap.namespace == _ISTIO_NAMESPACE:
            try:
                mesh = yaml.safe_load((configmap.body.get("data") or {}).get("mesh", "")) or {}
            except yaml.YAMLError:
                return {}
            return mesh if isinstance(mesh, dict) else {}
    return {}


@_analyzer("ServiceEntry")
def _conflicting_service_entry_protocols(objects: Objects) -> Iterator[Message]:
    """serviceentry.ConflictingServiceEntryProtocolAnalyzer: IST0177."""
    index: dict[tuple[str, str, int], list[tuple[str, Resource]]] = defaultdict(list)
    for entry in objects("ServiceEntry"):
        export_to = entry.spec.get("exportTo") or []
        scopes = ["*"] if not export_to or "*" in export_to else \
            list(dict.fromkeys(entry.namespace if e == "." else e for e in export_to))
        for scope in scopes:
            for host in entry.spec.get("hosts") or []:
                for port in entry.spec.get("ports") or []:
                    index[(scope, host, port.get("number", 0))].append((port.get("protocol", ""), entry))
    reported = set()
    for (scope, host, number), entries in index.items():
        if scope != "*":
            entries = entries + index.get(("*", host, number), [])
        protocols = sorted({protocol.upper() for protocol, _ in entries})
        if len(protocols) < 2:
            continue
        names = ", ".join(sorted({entry.full_name for _, entry in entries}))
        for _, entry in entries:
            if entry.full_name not in reported:
                reported.add(entry.full_name)
                yield Message("IST0177", entry, (names, go_quote(host), number, ", ".join(protocols)), _NAME)


# --- DestinationRule ---

@_analyzer("DestinationRule")
def _ca_certificates(objects: Objects) -> Iterator[Message]:
    """destinationrule.CaCertificateAnalyzer: IST0128, IST0129."""
    for dr in objects("DestinationRule"):
        policy = dr.spec.get("trafficPolicy") or {}
        selector = dr.spec.get("workloadSelector") is not None
        if _unverified(policy.get("tls") or {}, selector):
            yield Message("IST0128", dr, (dr.full_name, dr.namespace, policy["tls"]["mode"], dr.spec.get("host", "")),
                          "{.spec.trafficPolicy.tls.caCertificates}")
        for i, settings in enumerate(policy.get("portLevelSettings") or []):
            if _unverified(settings.get("tls") or {}, selector):
                port = settings.get("port") or {}
                # Go's String() of the PortSelector proto.
                shown = f"number:{port['number']}" if port.get("number") else ""
                yield Message("IST0129", dr, (dr.full_name, dr.namespace, settings["tls"]["mode"],
                                              dr.spec.get("host", ""), shown),
                              f"{{.spec.trafficPolicy.portLevelSettings[{i}].tls.caCertificates}}")


def _unverified(tls: Mapping[str, Any], has_selector: bool) -> bool:
    return tls.get("mode") in ("SIMPLE", "MUTUAL") and not tls.get("caCertificates") and \
        not (tls.get("credentialName") and has_selector)


@_analyzer("DestinationRule", "Pod", "Service", "ServiceEntry", "Node")
def _subsets_select_pods(objects: Objects) -> Iterator[Message]:
    """destinationrule.PodNotSelectedAnalyzer: IST0174, IST0173."""
    hosts = _service_entry_hosts(objects)
    for dr in objects("DestinationRule"):
        entry = _destination_host(dr.namespace, dr.spec.get("exportTo") or [], dr.spec.get("host", ""), hosts)
        if entry is None:
            yield Message("IST0174", dr, (dr.spec.get("host", ""),))
            continue
        base = (entry.get("workloadSelector") or {}).get("labels") or {}
        for subset in dr.spec.get("subsets") or []:
            selector = {**base, **(subset.get("labels") or {})}
            if not objects.any_selected(selector):
                yield Message("IST0173", dr, (subset.get("name", ""),))


# --- Gateway, Sidecar ---

@_analyzer("Gateway", "Pod", "Service")
def _gateway_ports(objects: Objects) -> Iterator[Message]:
    """gateway.IngressGatewayPortAnalyzer: IST0101 (selector), IST0162."""
    for gateway in objects("Gateway"):
        selector = gateway.spec.get("selector") or {}
        matched = objects.selected(selector)
        if not matched:
            yield Message("IST0101", gateway, ("selector", go_quote(_selector(selector))), _selector_path(selector))
            continue
        ports: set[int] = set()
        for pod in matched:
            for service in objects("Service"):
                if service.namespace == pod.namespace and _selects(service.spec.get("selector") or {}, pod.labels):
                    for p in service.spec.get("ports") or []:
                        if p.get("protocol", "TCP") == "TCP":
                            target = p.get("targetPort")
                            ports.add(p.get("port", 0))
                            if isinstance(target, int) and target:
                                ports.add(target)
        for server in gateway.spec.get("servers") or []:
            number = (server.get("port") or {}).get("number")
            if number is not None and number not in ports:
                yield Message("IST0162", gateway, (number, _selector(selector)), _selector_path(selector))


@_analyzer("Gateway")
def _duplicate_certificates(objects: Objects) -> Iterator[Message]:
    """gateway.CertificateAnalyzer: IST0138 (gateways not scoped to their namespace, istiod's default)."""
    for gateway in objects("Gateway"):
        selector = gateway.spec.get("selector") or {}
        for other in objects("Gateway"):
            if other.full_name == gateway.full_name or not _subset(selector, other.spec.get("selector") or {}):
                continue
            for server in gateway.spec.get("servers") or []:
                for theirs in other.spec.get("servers") or []:
                    if server.get("tls") is not None and theirs.get("tls") is not None and \
                            _same_certificate(server["tls"], theirs["tls"]):
                        yield Message("IST0138", gateway, (go_list([gateway.full_name, other.full_name]),), _NAME)


def _subset(x: Mapping[str, str], y: Mapping[str, str]) -> bool:
    """Every label of `x` is in `y` with its value (an empty `x` selects every gateway)."""
    return all(k in y and y[k] == v for k, v in x.items())


def _same_certificate(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.get("credentialName") and b.get("credentialName"):
        return bool(a["credentialName"] == b["credentialName"])
    if not a.get("credentialName") and not b.get("credentialName") and a.get("serverCertificate") and \
            a.get("serverCertificate") == b.get("serverCertificate") and a.get("privateKey") and b.get("privateKey"):
        return bool(a["privateKey"] == b["privateKey"])
    return False


@_analyzer("Gateway", "Pod")
def _conflicting_gateways(objects: Objects) -> Iterator[Message]:
    """gateway.ConflictingGatewayAnalyzer: IST0145, a host bound twice on one selector and port (a
    gateway's last server on a port stands for it, as in Istio's; its hosts are compared as written)."""
    bound: dict[tuple[str, int], dict[str, dict[str, str]]] = defaultdict(dict)
    for gateway in objects("Gateway"):
        for server in gateway.spec.get("servers") or []:
            key = (_selector(gateway.spec.get("selector") or {}), (server.get("port") or {}).get("number", 0))
            bound[key][gateway.full_name] = {h: server.get("bind", "") for h in server.get("hosts") or []}
    for gateway in objects("Gateway"):
        selector = gateway.spec.get("selector") or {}
        text = _selector(selector)
        same = [key for key in bound if key[0] == text or (key[0] in text or text in key[0]) and any(
            _selects(selector, p.labels) and _selects(_parse_selector(key[0]), p.labels) for p in objects("Pod"))]
        for server in gateway.spec.get("servers") or []:
            port = (server.get("port") or {}).get("number", 0)
            hosts, bind = server.get("hosts") or [], server.get("bind", "")
            others = sorted(name for key in same if key[1] == port for name, known in bound[key].items()
                            if name != gateway.full_name and any(known.get(h, None) == bind for h in hosts))
            if others:
                yield Message("IST0145", gateway, (",".join(others), text, port, ",".join(hosts)))


def _parse_selector(text: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in text.split(",") if pair.count("=") == 1)


@_analyzer("Gateway", "Pod", "Secret")
def _gateway_secrets(objects: Objects) -> Iterator[Message]:
    """gateway.SecretAnalyzer: IST0101 (selector, credentialName), IST0161. A credential is valid
    when istiod's own reading of the Secret takes it."""
    from istiod.sources.convert import ConversionError, convert  # the Secret's reading is istiod's

    for gateway in objects("Gateway"):
        selector = gateway.spec.get("selector") or {}
        namespace = next((p.namespace for p in objects.selected(selector)), "")
        if not namespace:
            yield Message("IST0101", gateway, ("selector", go_quote(_selector(selector))), _selector_path(selector))
            continue
        for i, server in enumerate(gateway.spec.get("servers") or []):
            path = f"{{.spec.servers[{i}].tls.credentialName}}"
            name = (server.get("tls") or {}).get("credentialName", "")
            if not name:
                continue
            ns, _, bare = name.rpartition("/")
            secret = next((s for s in objects("Secret") if s.namespace == (ns or namespace) and s.name == bare), None)
            if secret is None:
                yield Message("IST0101", gateway, ("credentialName", go_quote(name)), path)
                continue
            try:
                convert(secret.body)
            except ConversionError:
                yield Message("IST0161", gateway, (gateway.name, namespace), path)


@_analyzer("Sidecar", "Pod", "Namespace")
def _sidecar_selectors(objects: Objects) -> Iterator[Message]:
    """sidecar.SelectorAnalyzer: IST0101 (selector), IST0110, IST0111 (ambient pods and namespaces,
    IST0167, are not reported)."""
    pods_to_sidecars: dict[tuple[str, str], list[Resource]] = defaultdict(list)
    without: dict[str, list[Resource]] = defaultdict(list)
    for sidecar in objects("Sidecar"):
        selector = (sidecar.spec.get("workloadSelector") or {}).get("labels") or {}
        if not selector:
            without[sidecar.namespace].append(sidecar)
            continue
        matched = [p for p in objects.selected(selector) if p.namespace == sidecar.namespace]
        for pod in matched:
            pods_to_sidecars[(pod.namespace, pod.name)].append(sidecar)
        if not matched:
            first = _selector(selector).partition("=")[0]
            yield Message("IST0101", sidecar, ("selector", go_quote(_selector(selector))),
                          f"{{.spec.workloadSelector.labels.{first}}}")
    for (namespace, pod_name), sidecars in pods_to_sidecars.items():
        if len(sidecars) > 1:
            names = go_list(sorted(s.name for s in sidecars))
            for sidecar in sidecars:
                yield Message("IST0110", sidecar, (names, go_quote(namespace), go_quote(pod_name)), _NAME)
    for namespace, sidecars in without.items():
        if len(sidecars) > 1:
            names = go_list(sorted(s.name for s in sidecars))
            for sidecar in sidecars:
                yield Message("IST0111", sidecar, (names, go_quote(namespace)))


# --- AuthorizationPolicy ---

@_analyzer("AuthorizationPolicy", "Namespace", "Pod")
def _authorization_policies(objects: Objects) -> Iterator[Message]:
    """auth.AuthorizationPoliciesAnalyzer: IST0127 (no pod in the mesh selected), IST0101 (namespace)."""
    in_mesh: dict[str, list[Mapping[str, str]]] = defaultdict(list)
    for pod in objects("Pod"):
        if _pod_in_mesh(objects, pod) or pod.annotations.get("ambient.istio.io/redirection") == "enabled":
            in_mesh[pod.namespace].append(pod.labels)
    root = _mesh_config(objects).get("rootNamespace") or _ISTIO_NAMESPACE
    namespaces = [n.name for n in objects("Namespace")]
    for policy in objects("AuthorizationPolicy"):
        selector = policy.spec.get("selector")
        labels = (selector or {}).get("matchLabels") or {}
        if policy.namespace == root:
            if selector is not None and not any(_selects(labels, pod) for pods in in_mesh.values() for pod in pods):
                yield Message("IST0127", policy, (_selector(labels),))
        elif selector is None:
            if not in_mesh[policy.namespace]:
                yield Message("IST0127", policy, ("",))
        elif not any(_selects(labels, pod) for pod in in_mesh[policy.namespace]):
            yield Message("IST0127", policy, (_selector(labels),))
        for i, rule in enumerate(policy.spec.get("rules") or []):
            for j, source in enumerate(rule.get("from") or []):
                source = source.get("source") or {}
                for pattern, k in _with_index(source.get("namespaces") or []) + _with_index(source.get("notNamespaces") or []):
                    if not any(_namespace_matches(name, pattern) for name in namespaces):
                        # Istio points at `namespaces[k]` for a notNamespaces entry too.
                        yield Message("IST0101", policy, ("namespace", go_quote(pattern)),
                                      f"{{.spec.rules[{i}].from[{j}].source.namespaces[{k}]}}")


def _with_index(values: list[str]) -> list[tuple[str, int]]:
    return [(v, k) for k, v in enumerate(values)]


def _pod_in_mesh(objects: Objects, pod: Resource) -> bool:
    """util.PodInMesh."""
    containers = (pod.spec.get("containers") or []) + (pod.spec.get("initContainers") or [])
    return _in_mesh(objects, pod.namespace, pod.labels, pod.annotations, containers)


def _in_mesh(objects: Objects, namespace_name: str, labels: Mapping[str, str], annotations: Mapping[str, str],
             containers: Sequence[Mapping[str, Any]]) -> bool:
    """util.inMesh: a proxy container, else the inject label or annotation, else the namespace's label."""
    if any(c.get("name") == "istio-proxy" and c.get("image") for c in containers):
        return True
    for metadata in (labels, annotations):
        if "sidecar.istio.io/inject" in metadata:
            return metadata["sidecar.istio.io/inject"] == "true"
    namespace = objects.get("Namespace", "", namespace_name)
    return namespace is not None and namespace.labels.get("istio-injection") == "enabled"


def _namespace_matches(namespace: str, pattern: str) -> bool:
    if pattern == "*":
        return True
    if pattern.startswith("*"):
        return namespace.endswith(pattern[1:])
    if pattern.endswith("*"):
        return namespace.startswith(pattern[:-1])
    return namespace.lower() == pattern.lower()


# --- Kubernetes kinds ---

@_analyzer("Service")
def _port_names(objects: Objects) -> Iterator[Message]:
    """service.PortNameAnalyzer: IST0118, IST0150."""
    for service in objects("Service"):
        if _control_plane(service):
            continue  # Istio's control plane
        if service.labels.get("gateway.istio.io/managed") in ("istio.io-gateway-controller", "istio.io-mesh-controller",
                                                               "istio.io-eastwest-controller"):
            continue
        external = service.spec.get("type") == "ExternalName"
        for i, p in enumerate(service.spec.get("ports") or []):
            port = Port(name=p.get("name", ""), port=p.get("port", 0), protocol=p.get("protocol", "TCP"),
                        app_protocol=p.get("appProtocol", ""))
            protocol = port_protocol(port)
            if protocol is Protocol.UNSUPPORTED and port.port in _WELL_KNOWN_TCP_PORTS:
                protocol = Protocol.TCP
            if protocol is Protocol.UNSUPPORTED or port.name == "tcp" and external:
                if external:
                    yield Message("IST0150", service)
                else:
                    target = p.get("targetPort", 0)
                    yield Message("IST0118", service, (port.name, port.port, target), f"{{.spec.ports[{i}].port}}")


@_analyzer("Namespace", "Pod", "ConfigMap")
def _injection(objects: Objects) -> Iterator[Message]:
    """injection.Analyzer: IST0123, IST0148, IST0102, IST0103."""
    injected = set()
    for namespace in objects("Namespace"):
        if namespace.name == _ISTIO_NAMESPACE:
            continue
        labels = namespace.labels
        label = labels.get("istio-injection")
        found = [f"istio-injection={label}"] if label is not None else []
        found += [f"{key}={labels[key]}" for key in ("istio.io/rev", "istio.io/dataplane-mode")
                  if key in labels and (label is None or label == "enabled")]
        if len(found) > 1:
            yield Message("IST0123", namespace, (go_list(found),))
        if labels.get("istio.io/dataplane-mode") == "ambient":
            continue
        if not label and "istio.io/rev" not in labels:
            if _enabled_by_default(objects, labels.get("istio.io/rev", "")):
                yield Message("IST0148", namespace)
            else:
                yield Message("IST0102", namespace, (namespace.name, namespace.name), _NAME)
            continue
        if label == "enabled":
            injected.add(namespace.name)
    for pod in objects("Pod"):
        if pod.namespace not in injected:
            continue
        inject = pod.labels.get("sidecar.istio.io/inject", pod.annotations.get("sidecar.istio.io/inject", ""))
        if inject.lower() == "false" or pod.spec.get("hostNetwork"):
            continue
        containers = (pod.spec.get("containers") or []) + (pod.spec.get("initContainers") or [])
        if not any(c.get("name") == "istio-proxy" and c.get("image") for c in containers):
            yield Message("IST0103", pod, (pod.full_name,))


def _enabled_by_default(objects: Objects, revision: str) -> bool:
    name = "istio-sidecar-injector" if revision in ("", "default") else f"istio-sidecar-injector-{revision}"
    for configmap in objects("ConfigMap"):
        if configmap.name == name:
            try:
                values = json.loads((configmap.body.get("data") or {}).get("values", ""))
                return values["sidecarInjectorWebhook"]["enableNamespacesByDefault"] is True
            except (ValueError, KeyError, TypeError):
                return False
    return False


# --- deprecated fields, negative conditions, policies that cannot apply ---

@_analyzer("VirtualService", "Sidecar")
def _deprecated_fields(objects: Objects) -> Iterator[Message]:
    """deprecation.FieldAnalyzer: IST0002 (its CRD check needs the cluster's CRDs, which are not read)."""
    for vs in objects("VirtualService"):
        for route in vs.spec.get("http") or []:
            if ((route.get("fault") or {}).get("delay") or {}).get("percent", 0) > 0:
                yield Message("IST0002", vs, ("HTTPRoute.fault.delay.percent is deprecated; use "
                                              "HTTPRoute.fault.delay.percentage",))
    for sidecar in objects("Sidecar"):
        if (sidecar.spec.get("outboundTrafficPolicy") or {}).get("egressProxy") is not None:
            yield Message("IST0002", sidecar, ("OutboundTrafficPolicy.EgressProxy ignored",))


# The condition types, per kind, whose False status Istio reports.
_NEGATIVE_CONDITIONS = {
    "Service": ("istio.io/WaypointBound",), "ServiceEntry": ("istio.io/WaypointBound",),
    "WorkloadEntry": ("istio.io/WaypointBound",), "AuthorizationPolicy": ("ZtunnelAccepted", "WaypointAccepted"),
}


@_analyzer("ServiceEntry", "WorkloadEntry", "AuthorizationPolicy")
def _negative_conditions(objects: Objects) -> Iterator[Message]:
    """conditions.ConditionAnalyzer: IST0171, for the kinds analysis reads (Services from a cluster).
    As istioctl, on the status the cluster holds: a file's `status` is not read."""
    for kind, types in _NEGATIVE_CONDITIONS.items():
        for resource in objects(kind):
            if resource.reference:
                continue
            for condition in (resource.body.get("status") or {}).get("conditions") or []:
                kind_type, status, reason = condition.get("type"), condition.get("status"), condition.get("reason", "")
                if kind_type in types and status == "False" or (
                        kind == "AuthorizationPolicy" and kind_type == "WaypointAccepted" and reason == "PartiallyInvalid"):
                    yield Message("IST0171", resource, (kind_type, reason, condition.get("message", "")))


_ISTIO_PROXY_CONTAINERS = ("istio-proxy", "istio-operator")
_PROXY_UID = 1337


def _runs_as_proxy(spec: Mapping[str, Any]) -> bool:
    """A pod spec whose app runs as the proxy's UID (its own security context or a container's)."""
    uids = [(spec.get("securityContext") or {}).get("runAsUser")] + [
        (c.get("securityContext") or {}).get("runAsUser") for c in spec.get("containers") or []
        if c.get("name") not in _ISTIO_PROXY_CONTAINERS]
    return _PROXY_UID in uids


def _control_plane(resource: Resource) -> bool:
    """util.IsIstioControlPlane: an `istio` label, or `release: istio`."""
    return "istio" in resource.labels or resource.labels.get("release") == "istio"


@_analyzer("Pod")
def _application_uid(objects: Objects) -> Iterator[Message]:
    """deployment.ApplicationUIDAnalyzer: IST0144, for Pods (and Deployments, below)."""
    for pod in objects("Pod"):
        if not _control_plane(pod) and _runs_as_proxy(pod.spec):
            yield Message("IST0144", pod)


@_analyzer("Deployment")
def _application_uid_of_deployments(objects: Objects) -> Iterator[Message]:
    for deployment in objects("Deployment"):
        if not _control_plane(deployment) and _runs_as_proxy(_template(deployment).get("spec") or {}):
            yield Message("IST0144", deployment)


def _template(deployment: Resource) -> Mapping[str, Any]:
    return deployment.spec.get("template") or {}


@_analyzer("Deployment", "Service", "Namespace")
def _deployment_services(objects: Objects) -> Iterator[Message]:
    """deployment.MultiServiceAnalyzer: IST0116 (a port two Services of a Deployment's pods give
    different protocols), IST0137 (a targetPort they reach from different ports); waypoints left out."""
    for deployment in objects("Deployment"):
        template = _template(deployment)
        metadata, spec = template.get("metadata") or {}, template.get("spec") or {}
        labels = metadata.get("labels") or {}
        if (deployment.labels.get("gateway.istio.io/managed") == "istio.io-mesh-controller"
                or not _in_mesh(objects, deployment.namespace, labels, metadata.get("annotations") or {},
                                spec.get("containers") or [])):
            continue
        services = [s for s in objects("Service") if s.namespace == deployment.namespace
                    and s.spec.get("selector") and _selects(s.spec["selector"], labels)]
        protocols: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        targets: dict[str, dict[int, str]] = defaultdict(dict)
        for service in services:
            for port in service.spec.get("ports") or []:
                number = port.get("port", 0)
                protocols[number][port.get("protocol") or "TCP"].append(service.full_name)
                target = str(port.get("targetPort") or "") or "0"
                targets[str(number) if target == "0" else target][number] = service.full_name
        for number, by_protocol in protocols.items():
            if len(by_protocol) > 1:
                names = sorted(n for group in by_protocol.values() for n in group)
                yield Message("IST0116", deployment, (deployment.name, number, go_list(names)), _NAME)
        for target, by_port in targets.items():
            if len(by_port) > 1:
                yield Message("IST0137", deployment, (deployment.name, go_list(sorted(by_port.values())),
                                                      go_quote(target), go_list(sorted(by_port))), _NAME)


def _jwt_claim_key(vs: Resource) -> str:
    """The first header match that routes by a JWT claim (`@request.auth.claims.a` or `...[a]`), or ""."""
    for route in vs.spec.get("http") or []:
        for match in route.get("match") or []:
            for key in [*(match.get("headers") or {}), *(match.get("withoutHeaders") or {})]:
                if routing_claim(key) is not None:
                    return str(key)
    return ""


@_analyzer("VirtualService", "RequestAuthentication", "Gateway", "Pod")
def _jwt_claim_routes(objects: Objects) -> Iterator[Message]:
    """virtualservice.JWTClaimRouteAnalyzer: IST0149, a gateway pod routing by a claim nothing verifies."""
    selectors: dict[str, list[Mapping[str, str]]] = defaultdict(list)
    for authn in objects("RequestAuthentication"):
        selectors[authn.namespace].append((authn.spec.get("selector") or {}).get("matchLabels") or {})
    for vs in objects("VirtualService"):
        if not (key := _jwt_claim_key(vs)):
            continue
        for name in vs.spec.get("gateways") or []:
            if name == "mesh":
                continue
            gateway_namespace, _, gateway_name = name.rpartition("/")
            gateway_namespace = gateway_namespace or vs.namespace
            gateway = objects.get("Gateway", gateway_namespace, gateway_name)
            if gateway is None:
                continue  # the gateway analyzer reports it
            for pod in objects.selected(gateway.spec.get("selector") or {}):
                candidates = selectors[_ISTIO_NAMESPACE] + selectors[pod.namespace]
                if not any(_selects(selector, pod.labels) for selector in candidates):
                    yield Message("IST0149", vs, (key, f"{gateway_namespace}/{gateway_name}", pod.name))




@_analyzer("AuthorizationPolicy", "RequestAuthentication", "Pod")
def _ineffective_selectors(objects: Objects) -> Iterator[Message]:
    """k8sgateway.SelectorAnalyzer: IST0166, a policy selecting a Kubernetes Gateway's pods by label."""
    gateway_pods: dict[str, list[Mapping[str, str]]] = defaultdict(list)
    for pod in objects("Pod"):
        if GATEWAY_NAME_LABEL in pod.labels:
            gateway_pods[pod.namespace].append(pod.labels)
    for kind in ("AuthorizationPolicy", "RequestAuthentication"):
        for policy in objects(kind):
            if policy.spec.get("targetRef") is not None or policy.spec.get("selector") is None:
                continue
            selector = policy.spec["selector"].get("matchLabels") or {}
            for labels in gateway_pods[policy.namespace]:
                if _selects(selector, labels):
                    yield Message("IST0166", policy, (labels[GATEWAY_NAME_LABEL],))


_ROUTE_CLASS = ("ROUTE_CONFIGURATION", "HTTP_ROUTE")


@_analyzer("EnvoyFilter")
def _envoy_filter_patches(objects: Objects) -> Iterator[Message]:
    """envoyfilter.EnvoyPatchAnalyzer: IST0151-IST0155, and the schema warning IST0133. Istio's, quirks included: REMOVE and ADD
    on HTTP_ROUTE are reported as ignored though istiod applies them; what a patch is named by (its
    value's `name`, else the filter it matches) collects, across the EnvoyFilters in order, from
    patches that match a proxy version, and a relative patch of such a name is IST0155."""
    versioned: list[tuple[str, str]] = []
    for envoy_filter in objects("EnvoyFilter"):
        yield Message("IST0133", envoy_filter, (envoyfilter.WARNING,))  # the only validation warning made here
        priority = envoy_filter.spec.get("priority") or 0
        for index, patch in enumerate(envoy_filter.spec.get("configPatches") or []):
            body, match = patch.get("patch"), patch.get("match") or {}
            if not body:
                break
            value = body.get("value")
            name: tuple[str, str] = ("", "")
            if isinstance(value, Mapping) and value:
                if "name" in value:
                    name = ("value", repr(value["name"]))
                elif (chain := (match.get("listener") or {}).get("filterChain")) is not None:
                    name = ("filter", str((chain.get("filter") or {}).get("name", "")))
            path, operation, apply_to = f"{{.spec.configPatches[{index}].patch.value}}", body.get("operation"), \
                patch.get("applyTo")
            relative = False
            if operation == "ADD" and apply_to in _ROUTE_CLASS:
                yield Message("IST0153", envoy_filter, (), path)
            elif operation == "REMOVE":
                if apply_to in _ROUTE_CLASS:
                    yield Message("IST0154", envoy_filter, (), path)
                relative = apply_to not in _ROUTE_CLASS
            elif operation == "REPLACE":
                if apply_to not in ("NETWORK_FILTER", "HTTP_FILTER", "VIRTUAL_HOST"):
                    yield Message("IST0152", envoy_filter, (), path)
                relative = apply_to in ("NETWORK_FILTER", "HTTP_FILTER", "VIRTUAL_HOST")
            else:
                relative = operation in ("INSERT_BEFORE", "INSERT_AFTER")
            if relative and priority == 0:
                yield Message("IST0155" if name in versioned else "IST0151", envoy_filter, (), path)
            if (match.get("proxy") or {}).get("proxyVersion"):
                versioned.append(name)

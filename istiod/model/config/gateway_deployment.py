"""Automated deployment: the ServiceAccount, Deployment and Service istiod's gateway deployment
controller makes for a Gateway of class `istio` (pilot/pkg/config/kube/gatewaycommon/
deploymentcontroller.go and its template kube-gateway.yaml), with Istio's names, labels and owner
references, the listeners' ports, spec.infrastructure's labels and annotations, and our proxy image
running our agent as a router (`istiod agent proxy router`); then the overlays of the class's defaults
and of spec.infrastructure.parametersRef's ConfigMap, which may add a HorizontalPodAutoscaler and a
PodDisruptionBudget.

Pure: a Gateway in, Kubernetes objects out (istiod/status/gateway_deployment.py applies them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from istiod.model.config.gateway_api import GROUP, ConfigMap, KubernetesGateway
from istiod.model.config.gateway_conversion import CLASS, GATEWAY_NAME_LABEL, WAYPOINT_CLASS
from istiod.model.strategic_merge import SCHEMAS, PatchError, strategic_merge

CLASS_NAME_LABEL = "gateway.networking.k8s.io/gateway-class-name"
MANAGED_LABEL = "gateway.istio.io/managed"
MANAGED = "istio.io-gateway-controller"
MESH_MANAGED = "istio.io-mesh-controller"  # a waypoint's
DEPLOYED_CLASSES = (CLASS, WAYPOINT_CLASS)
STATUS_PORT = 15021
# istiod leaves these annotations of spec.infrastructure (and the Gateway) off the objects it makes.
_OMITTED_ANNOTATIONS = frozenset({"kubectl.kubernetes.io/last-applied-configuration", "gateway.istio.io/name-override",
                                  "gateway.istio.io/service-account", "gateway.istio.io/controller-version"})


@dataclass(frozen=True, slots=True)
class GatewayInfrastructure:
    """What of a Gateway the API server holds beyond its model: its uid (the owner references'),
    spec.infrastructure's labels and annotations, and the Service type annotation."""

    uid: str
    labels: tuple[tuple[str, str], ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    service_type: str = ""  # networking.istio.io/service-type; "": the class's default (LoadBalancer, ClusterIP)


def deployed(gateway: KubernetesGateway) -> bool:
    """Whether istiod deploys the Gateway: class `istio` or `istio-waypoint`, managed (no spec.addresses
    naming a Service someone else deploys)."""
    return gateway.class_name in DEPLOYED_CLASSES and gateway.managed


def service_ports(gateway: KubernetesGateway) -> list[dict[str, Any]]:
    """istiod's extractServicePorts: status-port, then one port per listener port (the first
    listener's name, `.` as `-`, at most 63 characters, made unique with the port number)."""
    ports: list[dict[str, Any]] = [{"name": "status-port", "port": STATUS_PORT, "protocol": "TCP", "appProtocol": "tcp"}]
    used, numbers = {"status-port"}, set()
    for listener in gateway.listeners:
        if listener.port in numbers:
            continue
        numbers.add(listener.port)
        name = listener.name.replace(".", "-")[:63]
        candidate, suffix = name, f"-{listener.port}"
        while candidate in used:
            candidate = name[:63 - len(suffix)] + suffix
            suffix += "x"
        used.add(candidate)
        ports.append({"name": candidate, "port": listener.port, "protocol": "TCP",
                      "appProtocol": listener.protocol.lower()})
    return ports


def objects(gateway: KubernetesGateway, infrastructure: GatewayInfrastructure,
            variables: Mapping[str, str]) -> list[dict[str, Any]]:
    """The ServiceAccount, Deployment, Service, HorizontalPodAutoscaler and PodDisruptionBudget (in that
    order, as istiod applies them; the last two for `customized` to keep or drop), from its
    kube-gateway.yaml or, for a waypoint, waypoint.yaml (not in the mesh itself, our agent as a
    waypoint, a ClusterIP Service preferring close endpoints). `variables`: the injector's
    (proxy_image, ca_address, cluster_id)."""
    name, namespace = gateway.deployment_name, gateway.meta.namespace
    waypoint = gateway.class_name == WAYPOINT_CLASS
    account = gateway.service_account or name  # istiod's ServiceAccount: the annotation, else the deployment's name
    labels = {**dict(infrastructure.labels), GATEWAY_NAME_LABEL: gateway.meta.name,
              CLASS_NAME_LABEL: gateway.class_name}
    annotations = {k: v for k, v in infrastructure.annotations if k not in _OMITTED_ANNOTATIONS}
    owner = [{"apiVersion": f"{GROUP}/v1", "kind": "Gateway", "name": gateway.meta.name, "uid": infrastructure.uid}]

    def metadata(extra: Mapping[str, str] = {}, named: str = name) -> dict[str, Any]:
        return {"name": named, "namespace": namespace, "labels": {**labels, **extra}, "annotations": annotations,
                "ownerReferences": owner}

    managed = {MANAGED_LABEL: MESH_MANAGED if waypoint else MANAGED}
    pod_labels = {"sidecar.istio.io/inject": "false", **({"istio.io/dataplane-mode": "none"} if waypoint else {}),
                  "service.istio.io/canonical-name": name, "service.istio.io/canonical-revision": "latest",
                  **labels, **managed}
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    container = {
        "name": "istio-proxy",
        "image": variables["proxy_image"],
        "command": ["istiod"],
        "args": ["agent", "--output-dir", "/var/lib/istio/data", "proxy", "waypoint" if waypoint else "router",
                 "--workdir", "/"],
        "env": [{"name": "CA_ADDR", "value": variables["ca_address"]},
                {"name": "ISTIO_META_CLUSTER_ID", "value": variables["cluster_id"]},
                {"name": "POD_NAME", **field("metadata.name")}, {"name": "POD_NAMESPACE", **field("metadata.namespace")},
                {"name": "INSTANCE_IP", **field("status.podIP")},
                {"name": "SERVICE_ACCOUNT", **field("spec.serviceAccountName")},
                {"name": "ISTIO_META_WORKLOAD_NAME", "value": name},
                {"name": "ISTIO_META_OWNER",
                 "value": f"kubernetes://apis/apps/v1/namespaces/{namespace}/deployments/{name}"}],
        "ports": [{"containerPort": 15020, "name": "metrics", "protocol": "TCP"},
                  {"containerPort": STATUS_PORT, "name": "status-port", "protocol": "TCP"},
                  {"containerPort": 15090, "name": "http-envoy-prom", "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/healthz/ready", "port": STATUS_PORT}, "periodSeconds": 15,
                           "failureThreshold": 4, "timeoutSeconds": 1},
        "securityContext": {"allowPrivilegeEscalation": False, "privileged": False, "capabilities": {"drop": ["ALL"]},
                            "readOnlyRootFilesystem": True, "runAsUser": 1337, "runAsGroup": 1337,
                            "runAsNonRoot": True},
        "volumeMounts": [{"name": "workload-socket", "mountPath": "/var/run/secrets/workload-spiffe-uds"},
                         {"name": "istio-envoy", "mountPath": "/etc/istio/proxy"},
                         {"name": "istio-data", "mountPath": "/var/lib/istio/data"},
                         {"name": "istio-token", "mountPath": "/var/run/secrets/tokens"},
                         {"name": "istiod-ca-cert", "mountPath": "/var/run/secrets/istio"}],
    }
    volumes = [
        {"name": "workload-socket", "emptyDir": {}}, {"name": "istio-envoy", "emptyDir": {"medium": "Memory"}},
        {"name": "istio-data", "emptyDir": {}},
        {"name": "istio-token", "projected": {"sources": [{"serviceAccountToken": {
            "audience": "istio-ca", "expirationSeconds": 43200, "path": "istio-token"}}]}},
        {"name": "istiod-ca-cert", "configMap": {"name": "istio-ca-root-cert"}},
    ]
    service_spec: dict[str, Any] = {
        "ipFamilyPolicy": "PreferDualStack", "ports": service_ports(gateway),
        "selector": {GATEWAY_NAME_LABEL: gateway.meta.name},
        "type": infrastructure.service_type or ("ClusterIP" if waypoint else "LoadBalancer")}
    if gateway.addresses and service_spec["type"] == "LoadBalancer":  # a managed Gateway's one IPAddress
        service_spec["loadBalancerIP"] = gateway.addresses[0][1]
    service_metadata = metadata()
    if waypoint:  # istiod's waypoint Service keeps traffic close (its annotation, then the Gateway's)
        service_metadata["annotations"] = {"networking.istio.io/traffic-distribution": "PreferClose", **annotations}
    # Made only when an overlay names them (istiod's requiredOverlays).
    autoscaler = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": metadata(), "spec": {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}, "maxReplicas": 1}}
    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": metadata(), "spec": {
        "selector": {"matchLabels": {GATEWAY_NAME_LABEL: gateway.meta.name}}}}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(named=account)},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(managed), "spec": {
            "selector": {"matchLabels": {GATEWAY_NAME_LABEL: gateway.meta.name}},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": {
                    **annotations, "istio.io/rev": "default", "prometheus.io/path": "/stats/prometheus",
                    "prometheus.io/port": "15020", "prometheus.io/scrape": "true"}},
                "spec": {"serviceAccountName": account, "containers": [container], "volumes": volumes,
                         # Listeners on ports below 1024 without root, as istiod's template.
                         "securityContext": {"sysctls": [{"name": "net.ipv4.ip_unprivileged_port_start",
                                                          "value": "0"}]}}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": service_metadata, "spec": service_spec},
        autoscaler, budget,
    ]


class ParametersError(ValueError):
    """Overlays istiod cannot apply: the Gateway is not deployed (what it had is kept), one line why."""


def overlays(gateway: KubernetesGateway, config_maps: Iterable[ConfigMap], system_namespace: str) -> list[Mapping[str, str]]:
    """The overlays for the Gateway's objects, in istiod's order: its class's defaults (the oldest
    ConfigMap of istiod's namespace labelled gateway.istio.io/defaults-for-class: <class>), then its
    spec.infrastructure.parametersRef's ConfigMap."""
    config_maps = list(config_maps)
    found: list[Mapping[str, str]] = []
    defaults = sorted((c for c in config_maps if c.meta.namespace == system_namespace
                       and c.defaults_for_class == gateway.class_name), key=lambda c: (c.created, c.meta.name))
    if defaults:
        found.append(dict(defaults[0].data))
    ref = gateway.parameters_ref
    if ref is not None:
        if (ref.group, ref.kind) != ("", "ConfigMap"):
            raise ParametersError(f"invalid parameters: unknown infrastructure parameters type {ref.group}/{ref.kind}")
        named = next((c for c in config_maps if (c.meta.namespace, c.meta.name) == (gateway.meta.namespace, ref.name)), None)
        if named is None:
            raise ParametersError(f"parametersRef targeting configmap {gateway.meta.namespace}/{ref.name}, "
                                  "but configmap does not exist")
        found.append(dict(named.data))
    return found


def customized(bodies: Sequence[dict[str, Any]], overlays: Sequence[Mapping[str, str]]) -> list[dict[str, Any]]:
    """`objects`' output with the overlays applied as strategic merge patches, each under the key of its
    kind (istiod's applyOverlay): the HorizontalPodAutoscaler and PodDisruptionBudget only when one names
    them; an overlay may not rename an object or change its owners."""
    for overlay in overlays:
        unknown = sorted(set(overlay) - set(OVERLAY_KEYS.values()))
        if unknown:
            raise ParametersError(f"unsupported overlay {unknown[0]!r} (supported: {sorted(OVERLAY_KEYS.values())})")
    out = []
    for body in bodies:
        kind = body["kind"]
        key = OVERLAY_KEYS[kind]
        applied = False
        for overlay in overlays:
            if key not in overlay:
                continue
            try:
                patch = yaml.safe_load(overlay[key])
            except yaml.YAMLError as error:
                raise ParametersError(f"overlay {key!r}: not YAML: {str(error).splitlines()[0]}") from None
            if patch is None:
                continue
            if not isinstance(patch, Mapping):
                raise ParametersError(f"overlay {key!r}: not a map")
            try:
                merged = strategic_merge(body, patch, SCHEMAS[kind])
            except PatchError as error:
                raise ParametersError(f"overlay {key!r}: strategic merge patch failed: {error}") from None
            if {k: (merged.get("metadata") or {}).get(k) for k in _FIXED_METADATA} != \
                    {k: body["metadata"].get(k) for k in _FIXED_METADATA}:
                raise ParametersError(f"overlay {key!r}: illegal metadata change")
            body, applied = merged, True
        if applied or kind not in _REQUIRED_OVERLAYS:
            out.append(body)
    return out


# Object kind -> the ConfigMap key of its overlay.
OVERLAY_KEYS = {"ServiceAccount": "serviceAccount", "Deployment": "deployment", "Service": "service",
                "HorizontalPodAutoscaler": "horizontalPodAutoscaler", "PodDisruptionBudget": "podDisruptionBudget"}
_REQUIRED_OVERLAYS = frozenset({"HorizontalPodAutoscaler", "PodDisruptionBudget"})
_FIXED_METADATA = ("name", "generateName", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                   "deletionTimestamp", "deletionGracePeriodSeconds", "ownerReferences", "finalizers", "managedFields")


def infrastructure_of(raw: Mapping[str, Any]) -> GatewayInfrastructure:
    """A stored Gateway's uid, spec.infrastructure and service type (strings only; others skipped)."""
    metadata = raw.get("metadata") or {}
    infrastructure = (raw.get("spec") or {}).get("infrastructure") or {}

    def strings(value: Any) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((k, v) for k, v in value.items() if isinstance(k, str) and isinstance(v, str))
                     ) if isinstance(value, Mapping) else ()

    service_type = (metadata.get("annotations") or {}).get("networking.istio.io/service-type")
    return GatewayInfrastructure(str(metadata.get("uid") or ""), strings(infrastructure.get("labels")),
                                 strings(infrastructure.get("annotations")),
                                 service_type if isinstance(service_type, str) else "")

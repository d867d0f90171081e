"""The sidecar injection webhook (istiod's `/inject`): a Pod's AdmissionReview in, a JSONPatch out
that adds the `istio-proxy` container, the `istio-init` capture (or, in CNI mode, the annotations
the CNI plugin reads), their volumes, the `security.istio.io/tlsMode` label and the
`sidecar.istio.io/status` annotation.

The template and its values come from the injector ConfigMap (`istio-sidecar-injector`, keys
`config` and `values`), as istiod's. istiod's template is a Go template; ours is YAML whose string
leaves may hold `${name}` placeholders (listed in PLACEHOLDERS); a `{{` is refused, never passed on.
With `layout: istio` in `config` there is no template: the pod gets Istio's own layout (Istio's proxy
image running `pilot-agent`, see istio_layout), rendered from the same `values`.
"""

from __future__ import annotations

import base64
import json
import logging
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from fastapi import FastAPI

from istiod.model.config.proxy_config import ProxyConfig
from istiod.model.mesh import DEFAULT_ROOT_NAMESPACE
from istiod.model.quantity import QuantityError, parse_quantity
from istiod.revision import service_name
from istiod.sources.fields import _Fields
from istiod.webhooks.admission import add_review_route, admission_answer, admission_request
from istiod.webhooks import istio_layout
from istiod.webhooks.annotations import annotation_errors

log = logging.getLogger(__name__)
CONFIGMAP = "istio-sidecar-injector"
PATH = "/inject"
PROXY = "istio-proxy"
INIT = "istio-init"
INJECT = "sidecar.istio.io/inject"
STATUS = "sidecar.istio.io/status"
TLS_MODE = "security.istio.io/tlsMode"
IGNORED_NAMESPACES = ("kube-system", "kube-public")  # istiod never injects there
# Annotation -> (the resources field it sets, the resource).
RESOURCE_ANNOTATIONS = {
    "sidecar.istio.io/proxyCPU": ("requests", "cpu"),
    "sidecar.istio.io/proxyMemory": ("requests", "memory"),
    "sidecar.istio.io/proxyCPULimit": ("limits", "cpu"),
    "sidecar.istio.io/proxyMemoryLimit": ("limits", "memory"),
}
# Capture annotations (istio-iptables' flags) and their defaults, as istiod's template.
TRAFFIC_ANNOTATIONS = {
    "traffic.sidecar.istio.io/includeOutboundIPRanges": ("include_outbound_ip_ranges", "*"),
    "traffic.sidecar.istio.io/excludeOutboundIPRanges": ("exclude_outbound_ip_ranges", ""),
    "traffic.sidecar.istio.io/includeInboundPorts": ("include_inbound_ports", "*"),
    "traffic.sidecar.istio.io/excludeInboundPorts": ("exclude_inbound_ports", "15090,15021,15020"),
    "traffic.sidecar.istio.io/excludeOutboundPorts": ("exclude_outbound_ports", ""),
}
# CNI mode: the plugin reads these from the pod instead of an init container running iptables.
CNI_ANNOTATIONS = ("sidecar.istio.io/interceptionMode", *TRAFFIC_ANNOTATIONS)
PLACEHOLDERS = ("proxy_image", "ca_address", "cluster_id", "istio_namespace",
                *(name for name, _ in TRAFFIC_ANNOTATIONS.values()))
_CONFIG_FIELDS = ("policy", "templates", "defaultTemplates", "injectedAnnotations", "alwaysInjectSelector",
                  "neverInjectSelector", "template", "layout")
LAYOUTS = ("istiod", "istio")  # our agent's container layout, or Istio's (pilot-agent)
_TEMPLATE_FIELDS = ("containers", "initContainers", "volumes")


class InjectionError(ValueError):
    """A bad injector config or a pod annotation we cannot honour, in one line."""


@dataclass(frozen=True)
class Injector:
    """The parsed `istio-sidecar-injector` ConfigMap."""

    enabled: bool  # policy: enabled injects pods the webhook is sent unless they opt out
    template: Mapping[str, Any]  # containers, initContainers, volumes with placeholders
    values: Mapping[str, Any] = field(default_factory=dict)
    injected_annotations: Mapping[str, str] = field(default_factory=dict)
    layout: str = "istiod"
    # The store's ProxyConfig objects and the mesh's root namespace, which the pod's ProxyConfig merges.
    proxy_configs: tuple[ProxyConfig, ...] = ()
    root_namespace: str = DEFAULT_ROOT_NAMESPACE
    mesh_default_config: Mapping[str, Any] = field(default_factory=dict)  # istiod's mesh config's defaultConfig

    @property
    def cni(self) -> bool:
        return bool(_get(self.values, "istio_cni", "enabled"))

    def variables(self) -> dict[str, str]:
        """The placeholders' values from `values`, with istiod's chart defaults."""
        hub, tag = _get(self.values, "global", "hub") or "docker.io/istio", _get(self.values, "global", "tag") or "latest"
        image = str(_get(self.values, "global", "proxy", "image") or "proxyv2")
        namespace = str(_get(self.values, "global", "istioNamespace") or "istio-system")
        return {
            "proxy_image": image if "/" in image else f"{hub}/{image}:{tag}",  # as the chart spells it
            "istio_namespace": namespace,
            "ca_address": str(_get(self.values, "global", "caAddress")
                              or f"{service_name(str(self.values.get('revision') or ''))}.{namespace}.svc:15012"),
            "cluster_id": str(_get(self.values, "global", "multiCluster", "clusterName") or "Kubernetes"),
        }

    def resources(self) -> dict[str, Any]:
        resources = _get(self.values, "global", "proxy", "resources")
        return json.loads(json.dumps(resources)) if isinstance(resources, dict) else {}


def _get(tree: Mapping[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(tree, Mapping):
            return None
        tree = tree.get(key)  # type: ignore[assignment]
    return tree


def parse_injector(config_text: str, values_text: str, where: str) -> Injector:
    """The ConfigMap's `config` (YAML) and `values` (JSON, or YAML) keys; InjectionError names the field."""
    try:
        config = yaml.safe_load(config_text) or {}
        values = yaml.safe_load(values_text) or {}
    except yaml.YAMLError as error:
        raise InjectionError(f"{where}: not YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(config, dict) or not isinstance(values, dict):
        raise InjectionError(f"{where}: config and values must be maps")
    unknown = sorted(set(config) - set(_CONFIG_FIELDS))
    if unknown:
        raise InjectionError(f"{where}: config.{unknown[0]}: not a field of the injector config")
    for selector in ("alwaysInjectSelector", "neverInjectSelector"):
        if config.get(selector):
            raise InjectionError(f"{where}: config.{selector}: not implemented; use {INJECT} on the pod")
    policy = config.get("policy", "enabled")
    if policy not in ("enabled", "disabled"):
        raise InjectionError(f"{where}: config.policy: {policy!r} is not enabled or disabled")
    if config.get("defaultTemplates", ["sidecar"]) != ["sidecar"]:
        raise InjectionError(f"{where}: config.defaultTemplates: only [sidecar] is implemented")
    layout = config.get("layout", "istiod")
    if layout not in LAYOUTS:
        raise InjectionError(f"{where}: config.layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    annotations = config.get("injectedAnnotations") or {}
    injected = {str(k): str(v) for k, v in annotations.items()}
    if layout == "istio":
        if config.get("templates") or config.get("template"):
            raise InjectionError(f"{where}: config.templates: layout istio renders Istio's own template; remove it")
        return Injector(policy == "enabled", {}, values, injected, layout)
    text = (config.get("templates") or {}).get("sidecar", config.get("template"))
    if not isinstance(text, str) or not text.strip():
        raise InjectionError(f"{where}: config.templates.sidecar: missing")
    if "{{" in text:
        raise InjectionError(f"{where}: config.templates.sidecar: Go template syntax ({{{{) is not evaluated; "
                             f"use ${{name}} placeholders: {', '.join(PLACEHOLDERS)}")
    try:
        template = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise InjectionError(f"{where}: config.templates.sidecar: not YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(template, dict) or set(template) - set(_TEMPLATE_FIELDS):
        raise InjectionError(f"{where}: config.templates.sidecar: a map of {', '.join(_TEMPLATE_FIELDS)} only")
    if not any(c.get("name") == PROXY for c in template.get("containers") or [] if isinstance(c, dict)):
        raise InjectionError(f"{where}: config.templates.sidecar: no container named {PROXY}")
    unknown_names = sorted(_placeholders(template) - set(PLACEHOLDERS))
    if unknown_names:
        raise InjectionError(f"{where}: config.templates.sidecar: unknown placeholder ${{{unknown_names[0]}}}")
    return Injector(policy == "enabled", template, values, injected)


def _placeholders(tree: Any) -> set[str]:
    if isinstance(tree, str):
        return {m.group("braced") or m.group("named") for m in string.Template.pattern.finditer(tree)
                if m.group("braced") or m.group("named")}
    if isinstance(tree, dict):
        return set().union(*map(_placeholders, tree.values())) if tree else set()
    if isinstance(tree, list):
        return set().union(*map(_placeholders, tree)) if tree else set()
    return set()


def _fill(tree: Any, variables: Mapping[str, str]) -> Any:
    """Placeholders are filled in string leaves, after parsing, so a value cannot change the YAML."""
    if isinstance(tree, str):
        return string.Template(tree).substitute(variables)
    if isinstance(tree, dict):
        return {key: _fill(value, variables) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_fill(value, variables) for value in tree]
    return tree


def wants_injection(pod: Mapping[str, Any], namespace: str, injector: Injector) -> bool:
    """istiod's injectRequired: the label, then the annotation, then the policy. The webhook's
    namespaceSelector/objectSelector decide which pods are sent at all."""
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if spec.get("hostNetwork") or namespace in IGNORED_NAMESPACES:
        return False
    if STATUS in (metadata.get("annotations") or {}):
        return False  # already injected
    choice = (metadata.get("labels") or {}).get(INJECT, (metadata.get("annotations") or {}).get(INJECT))
    if choice is None:
        return injector.enabled
    return str(choice).lower() in ("true", "y", "yes", "on")


def _proxy_resources(injector: Injector, annotations: Mapping[str, str]) -> dict[str, Any]:
    resources = injector.resources()
    for annotation, (kind, resource) in RESOURCE_ANNOTATIONS.items():
        if annotation in annotations:
            try:
                parse_quantity(annotations[annotation])
            except QuantityError as error:
                raise InjectionError(f"annotation {annotation}: {error}") from None
            resources.setdefault(kind, {})[resource] = annotations[annotation]
    return resources


def _own_layout(pod: Mapping[str, Any], injector: Injector, annotations: Mapping[str, str],
                config: Mapping[str, Any]) -> istio_layout.Layout:
    """Our template, filled: `istiod agent` as the proxy container, given the pod's ProxyConfig as
    Istio's template gives it (PROXY_CONFIG, and each proxyMetadata entry as a variable of its own);
    holdApplicationUntilProxyStarts puts it first with a postStart `istiod agent wait`."""
    spec = pod.get("spec") or {}
    variables = injector.variables()
    for annotation, (name, default) in TRAFFIC_ANNOTATIONS.items():
        variables[name] = annotations.get(annotation, default)
    rendered = _fill(injector.template, variables)
    hold = bool(config.get("holdApplicationUntilProxyStarts")
                or _get(injector.values, "global", "proxy", "holdApplicationUntilProxyStarts"))
    resources = _proxy_resources(injector, annotations)
    for proxy in rendered.get("containers") or []:
        if proxy.get("name") == PROXY:
            if resources:
                proxy["resources"] = resources
            own = [e for e in proxy.get("env") or [] if e.get("name") != "PROXY_CONFIG"
                   and e.get("name") not in (config.get("proxyMetadata") or {})]
            proxy["env"] = [*own, {"name": "PROXY_CONFIG", "value": json.dumps(config, separators=(",", ":"), sort_keys=True)},
                            *({"name": k, "value": str(v)} for k, v in (config.get("proxyMetadata") or {}).items())]
            if hold:  # the apps' containers start once this hook has seen the proxy ready
                proxy["lifecycle"] = {**(proxy.get("lifecycle") or {}),
                                      "postStart": {"exec": {"command": ["istiod", "agent", "wait"]}}}
    inits = rendered.get("initContainers") or []
    added: dict[str, str] = {}
    if injector.cni:  # the CNI plugin captures instead, reading the pod's annotations
        inits = [c for c in inits if c.get("name") != INIT]
        added["sidecar.istio.io/interceptionMode"] = annotations.get("sidecar.istio.io/interceptionMode", "REDIRECT")
        for annotation, (name, _) in TRAFFIC_ANNOTATIONS.items():
            added[annotation] = variables[name]
    app_containers = list(spec.get("containers") or [])
    if app_containers:
        for key in ("kubectl.kubernetes.io/default-container", "kubectl.kubernetes.io/default-logs-container"):
            added[key] = annotations.get(key, app_containers[0].get("name", ""))
    return istio_layout.Layout(inits, [], list(rendered.get("containers") or []), hold,
                               list(rendered.get("volumes") or []), app_containers,
                               list(spec.get("initContainers") or []), {TLS_MODE: "istio"}, added)


def inject(pod: Mapping[str, Any], injector: Injector, revision: str = "default",
           namespace: str = "") -> list[dict[str, Any]]:
    """The JSONPatch that injects the sidecar into `pod` (of `namespace`, when its metadata has none).
    Each changed field is one `add` of its whole new value (an add replaces a member that exists), as
    small as the API needs."""
    metadata = pod.get("metadata") or {}
    if namespace and not metadata.get("namespace"):
        pod = {**pod, "metadata": {**metadata, "namespace": namespace}}
    spec = pod.get("spec") or {}
    annotations: dict[str, str] = dict(metadata.get("annotations") or {})
    errors = annotation_errors(annotations)
    if errors:
        raise InjectionError("; ".join(errors))
    if injector.layout == "istio":
        try:
            layout = istio_layout.render(pod, injector.values, annotations, revision=revision,
                                         configs=injector.proxy_configs, root_namespace=injector.root_namespace,
                                         mesh_default=injector.mesh_default_config)
        except istio_layout.LayoutError as error:
            raise InjectionError(str(error)) from None
        _proxy_resources(injector, annotations)  # the resource annotations' quantities checked, as ours
    else:
        try:
            config = istio_layout.proxy_config(
                injector.values, annotations, str((pod.get("metadata") or {}).get("namespace") or ""),
                (pod.get("metadata") or {}).get("labels") or {}, injector.proxy_configs, injector.root_namespace,
                injector.mesh_default_config)
        except istio_layout.LayoutError as error:
            raise InjectionError(str(error)) from None
        layout = _own_layout(pod, injector, annotations, config)
    taken = {c.get("name") for c in spec.get("containers") or []} | {c.get("name") for c in spec.get("initContainers") or []}
    inits = layout.init_containers + layout.init_containers_last
    clash = sorted(taken & {c.get("name") for c in layout.containers + inits})
    if clash:
        raise InjectionError(f"container {clash[0]} exists already; remove it or set {INJECT}: \"false\"")
    containers = (layout.containers + layout.app_containers if layout.proxy_first
                  else layout.app_containers + layout.containers)
    init_containers = layout.init_containers + layout.app_init_containers + layout.init_containers_last
    volumes = list(spec.get("volumes") or []) + layout.volumes
    if injector.layout == "istio":
        annotations.update(layout.annotations)  # Istio's template sets these over the pod's
    else:
        annotations = {**layout.annotations, **annotations}
    annotations.update(injector.injected_annotations)
    annotations[STATUS] = json.dumps({
        "initContainers": [c.get("name") for c in inits] or None,
        "containers": [c.get("name") for c in layout.containers] or None,
        "volumes": [v.get("name") for v in layout.volumes],
        "imagePullSecrets": None, "revision": revision,  # istiod's own, not the tag that selected the pod
    }, separators=(",", ":"))
    labels = {**(metadata.get("labels") or {}), **layout.labels}
    patch: list[dict[str, Any]] = [{"op": "add", "path": "/metadata/labels", "value": labels},
             {"op": "add", "path": "/metadata/annotations", "value": annotations},
             {"op": "add", "path": "/spec/containers", "value": containers}]
    if init_containers:
        patch.append({"op": "add", "path": "/spec/initContainers", "value": init_containers})
    if volumes:
        patch.append({"op": "add", "path": "/spec/volumes", "value": volumes})
    return patch


def review(body: Any, injector: Injector | None, revision: str = "default") -> dict[str, Any]:
    """An AdmissionReview of a Pod -> the answer, with the patch when the pod gets a sidecar.
    ValueError if malformed; LookupError if there is no injector config (the API server then
    applies the webhook's failurePolicy)."""
    request, uid = admission_request(body)
    pod = request.get("object") or {}
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if pod.get("kind") == "Pod" and request.get("operation", "CREATE") == "CREATE":
        _check_pod(pod)
        if injector is None:
            raise LookupError(f"no injector config: the ConfigMap {CONFIGMAP} is missing or invalid")
        namespace = request.get("namespace") or (pod.get("metadata") or {}).get("namespace", "")
        name = (pod.get("metadata") or {}).get("name") or (pod.get("metadata") or {}).get("generateName", "")
        if wants_injection(pod, namespace, injector):
            try:
                patch = inject(pod, injector, revision, namespace)
            except InjectionError as error:
                log.info("injection refused pod %s/%s: %s", namespace, name, error)
                response = {"uid": uid, "allowed": False,
                            "status": {"code": 400, "reason": "BadRequest", "message": f"injection failed: {error}"}}
            else:
                response["patchType"] = "JSONPatch"
                response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
                log.debug("injected a sidecar into pod %s/%s", namespace, name)
    return admission_answer(body, response)


def _check_pod(pod: Mapping[str, Any]) -> None:
    """The Pod fields injection reads, typed as the API server types them; ValueError names the field."""
    f = _Fields("request.object", pod)
    for path in ("metadata.name", "metadata.generateName", "metadata.namespace"):
        f.get(path, str, "")
    f.str_map("metadata.labels")
    f.str_map("metadata.annotations")
    f.get("spec.hostNetwork", bool, False)
    for path in ("spec.containers", "spec.initContainers", "spec.volumes"):
        for item in f.items(path):
            item.get("name", str, "")


def add_injection_route(app: FastAPI, current: Callable[[], Injector | None], revision: str = "default") -> None:
    add_review_route(app, (PATH,), lambda body: review(body, current(), revision))

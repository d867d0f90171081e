"""Istio's own sidecar layout (the injector config's `layout: istio`): what Istio's injection template
(istio-discovery/files/injection-template.yaml) renders for a pod, for meshes that run Istio's proxy
image (`pilot-agent proxy sidecar` and Envoy) against this istiod.

Pure: the pod, the injector's values (Istio's value names and defaults) and the pod's annotations in,
the containers, volumes, labels and annotations out. Also as Istio: app HTTP/TCP/gRPC probes are
rewritten to the agent's status port (`/app-health/<container>/readyz|livez|startupz`, the originals
in ISTIO_KUBE_APP_PROBERS), `holdApplicationUntilProxyStarts` puts the proxy first with a postStart
`pilot-agent wait`, and native sidecars make istio-proxy an init container with restartPolicy Always.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from istiod.model.config.proxy_config import ProxyConfig, effective_proxy_config, merge_proxy_config
from istiod.model.mesh import DEFAULT_ROOT_NAMESPACE
from istiod.model.workload import OwnerRef, workload_identity
from istiod.revision import service_name

PROXY = "istio-proxy"
INIT = "istio-init"
VALIDATION = "istio-validation"
PROXY_UID = 1337
REWRITE_PROBES = "sidecar.istio.io/rewriteAppHTTPProbers"
NATIVE_SIDECAR = "sidecar.istio.io/nativeSidecar"
PROXY_CONFIG = "proxy.istio.io/config"
STATUS_PORT = "status.sidecar.istio.io/port"
INTERCEPTION_MODE = "sidecar.istio.io/interceptionMode"
_GO_TRUE = ("1", "t", "T", "TRUE", "true", "True")
_GO_FALSE = ("0", "f", "F", "FALSE", "false", "False")
# Istio's chart values the template reads, with its defaults (istio-discovery/values.yaml).
DEFAULTS: Mapping[str, Any] = {
    "global": {
        "hub": "docker.io/istio", "tag": "latest", "istioNamespace": "istio-system", "caAddress": "",
        "pilotCertProvider": "istiod", "network": "", "meshID": "", "imagePullPolicy": "",
        "logging": {"level": "default:info"}, "logAsJson": False, "multiCluster": {"clusterName": "Kubernetes"},
        "sds": {"token": {"aud": "istio-ca"}}, "sts": {"servicePort": 0}, "nativeSidecar": False,
        "proxy": {
            "image": "proxyv2", "clusterDomain": "cluster.local", "logLevel": "warning",
            "componentLogLevel": "misc:error", "outlierLogPath": "", "statusPort": 15020, "privileged": False,
            "holdApplicationUntilProxyStarts": False, "includeIPRanges": "*", "excludeIPRanges": "",
            "includeInboundPorts": "*", "excludeInboundPorts": "", "includeOutboundPorts": "",
            "excludeOutboundPorts": "", "readinessInitialDelaySeconds": 0, "readinessPeriodSeconds": 15,
            "readinessFailureThreshold": 4, "startupProbe": {"enabled": True, "failureThreshold": 600},
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                          "limits": {"cpu": "2000m", "memory": "1024Mi"}},
        },
        "proxy_init": {"image": "proxyv2"},
    },
    "sidecarInjectorWebhook": {"rewriteAppHTTPProbe": True},
    "istio_cni": {"enabled": False},
    "meshConfig": {},
}


class LayoutError(ValueError):
    """A pod annotation or value the layout cannot use, in one line."""


@dataclass(frozen=True)
class Layout:
    """What injection adds to or changes in the pod."""

    init_containers: list[dict[str, Any]]  # before the pod's own (istio-validation; istio-init and istio-proxy when native)
    init_containers_last: list[dict[str, Any]]  # after the pod's own (istio-init, so they run uncaptured)
    containers: list[dict[str, Any]]  # the regular istio-proxy container, when not native
    proxy_first: bool  # holdApplicationUntilProxyStarts: istio-proxy before the app containers
    volumes: list[dict[str, Any]]
    app_containers: list[dict[str, Any]]  # the pod's containers, probes rewritten
    app_init_containers: list[dict[str, Any]]
    labels: dict[str, str]
    annotations: dict[str, str]


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) \
            else copy.deepcopy(value)
    return out


def _go_bool(text: str, name: str) -> bool:
    if text in _GO_TRUE:
        return True
    if text in _GO_FALSE:
        return False
    raise LayoutError(f"annotation {name}: {text!r} is not a boolean")


def _image(values: Mapping[str, Any], image: str) -> str:
    return image if "/" in image else f"{values['global']['hub']}/{image}:{values['global']['tag']}"


def proxy_config(values: Mapping[str, Any], annotations: Mapping[str, str], namespace: str = "",
                 labels: Mapping[str, str] = {}, configs: Iterable[ProxyConfig] = (),
                 root_namespace: str = DEFAULT_ROOT_NAMESPACE, mesh_default: Mapping[str, Any] = {}) -> dict[str, Any]:
    """The pod's ProxyConfig: istiod's default discoveryAddress, the values' meshConfig.defaultConfig, then
    istiod's mesh config's (`mesh_default`, which Istio's injector reads; the chart writes both alike),
    then the ProxyConfig objects and the pod's `proxy.istio.io/config` in Istio's order."""
    istiod_namespace = (values.get("global") or {}).get("istioNamespace") or DEFAULTS["global"]["istioNamespace"]
    istiod = service_name(str(values.get("revision") or ""))  # the chart's values name the revision
    default = merge_proxy_config(merge_proxy_config({"discoveryAddress": f"{istiod}.{istiod_namespace}.svc:15012"},
                                                    values.get("meshConfig", {}).get("defaultConfig") or {}),
                                 mesh_default)
    override = None
    if PROXY_CONFIG in annotations:
        try:
            override = yaml.safe_load(annotations[PROXY_CONFIG])
        except yaml.YAMLError as error:
            raise LayoutError(f"annotation {PROXY_CONFIG}: not YAML: {str(error).splitlines()[0]}") from None
        if not isinstance(override, dict):
            raise LayoutError(f"annotation {PROXY_CONFIG}: not a ProxyConfig map")
    return effective_proxy_config(default, configs, root_namespace, namespace, labels, override)


def _probe_urls(container: str) -> dict[str, str]:
    """pilot-agent's FormatProberURL."""
    return {**{kind: f"/app-health/{container}/{kind}" for kind in ("readyz", "livez", "startupz")},
            **{kind: f"/app-lifecycle/{container}/{kind}" for kind in ("prestopz", "poststartz")}}


_PROBES = {"readinessProbe": "readyz", "livenessProbe": "livez", "startupProbe": "startupz"}
_HOOKS = {"preStop": "prestopz", "postStart": "poststartz"}
# Go's JSON field order of the actions (corev1's struct order), so the env is byte-equal to Istio's.
_ACTION_FIELDS = {"httpGet": ("path", "port", "host", "scheme", "httpHeaders"), "tcpSocket": ("port", "host"),
                  "grpc": ("port", "service")}


def _handlers(container: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], tuple[str, ...]]]:
    """(url kind, probe or lifecycle handler, the actions the agent takes over) of a container."""
    out: list[tuple[str, Mapping[str, Any], tuple[str, ...]]] = []
    for field, kind in _PROBES.items():
        if isinstance(container.get(field), dict):
            out.append((kind, container[field], ("httpGet", "tcpSocket", "grpc")))
    lifecycle = container.get("lifecycle")
    for field, kind in _HOOKS.items():
        if isinstance(lifecycle, dict) and isinstance(lifecycle.get(field), dict):
            out.append((kind, lifecycle[field], ("httpGet", "tcpSocket")))
    return out


def app_probers(containers: list[dict[str, Any]], status_port: int) -> str:
    """ISTIO_KUBE_APP_PROBERS (Istio's DumpAppProbers): each app probe and lifecycle hook the agent takes
    over, by its new path; named ports resolved to numbers; "" when there is none."""
    out: dict[str, Any] = {}
    for container in containers:
        if container.get("name") == PROXY:
            continue
        named = {p["name"]: p["containerPort"] for p in container.get("ports") or [] if p.get("name")}
        urls = _probe_urls(str(container.get("name", "")))
        for kind, handler, actions in _handlers(container):
            action_name = next((a for a in actions if a in handler), None)
            if action_name is None:
                continue
            action = dict(handler[action_name])
            if action_name != "grpc":  # a gRPC probe's port is a number already
                port = action.get("port")
                if isinstance(port, str):  # an IntOrString's string: a port name (Istio looks "8080" up too)
                    if port not in named:
                        continue  # left alone, as Istio does
                    action["port"] = named[port]
                elif not isinstance(port, int) or port == status_port:
                    continue  # no port (the API server refuses the pod later), or rewritten already
            prober: dict[str, Any] = {action_name: {k: action[k] for k in _ACTION_FIELDS[action_name] if action.get(k)
                                                    or k == "port"}}
            if handler.get("timeoutSeconds"):
                prober["timeoutSeconds"] = handler["timeoutSeconds"]
            out[urls[kind]] = prober
    return json.dumps(dict(sorted(out.items())), separators=(",", ":")) if out else ""


def rewrite_probes(container: dict[str, Any], status_port: int) -> dict[str, Any]:
    """Istio's convertProbe: each app probe and lifecycle hook becomes an HTTP GET of its path on the
    agent's status port (HTTPS becomes HTTP: the agent calls the app with the original scheme)."""
    out = copy.deepcopy(container)
    urls = _probe_urls(str(container.get("name", "")))
    for kind, handler, actions in _handlers(out):
        assert isinstance(handler, dict)
        if "httpGet" in handler:
            action = handler["httpGet"]
            action["port"], action["path"] = status_port, urls[kind]
            if action.get("scheme") == "HTTPS":
                action["scheme"] = "HTTP"
        elif any(a in handler for a in actions):
            for name in actions:
                handler.pop(name, None)
            handler["httpGet"] = {"path": urls[kind], "port": status_port}
    return out


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def _resource(resource: str) -> dict[str, Any]:
    return {"valueFrom": {"resourceFieldRef": {"resource": resource, "divisor": "1"}}}


def _resources(values: Mapping[str, Any], annotations: Mapping[str, str]) -> dict[str, Any]:
    """Istio's "resources" template: the annotations, when any is set, replace the values' resources."""
    by_annotation = {("requests", "cpu"): "sidecar.istio.io/proxyCPU",
                     ("requests", "memory"): "sidecar.istio.io/proxyMemory",
                     ("limits", "cpu"): "sidecar.istio.io/proxyCPULimit",
                     ("limits", "memory"): "sidecar.istio.io/proxyMemoryLimit"}
    if any(name in annotations for name in by_annotation.values()):
        out: dict[str, Any] = {}
        for (kind, resource), name in by_annotation.items():
            if name in annotations:
                out.setdefault(kind, {})[resource] = annotations[name]
        return out
    return copy.deepcopy(values["global"]["proxy"].get("resources") or {})


def _excluded_inbound(status_port: str, excluded: str) -> str:
    """Istio's excludeInboundPort: the status port added to the excluded inbound ports."""
    ports = [p for p in excluded.split(",") if p]
    return ",".join(ports if status_port in ports or status_port == "0" else [status_port, *ports])


def render(pod: Mapping[str, Any], values_in: Mapping[str, Any], annotations: Mapping[str, str],
           *, revision: str = "default", configs: Iterable[ProxyConfig] = (),
           root_namespace: str = DEFAULT_ROOT_NAMESPACE, mesh_default: Mapping[str, Any] = {}) -> Layout:
    """Istio's injection template for `pod` with `values_in` (Istio's values; absent ones default)."""
    values = _merge(DEFAULTS, values_in)
    g, proxy = values["global"], values["global"]["proxy"]
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    labels_in: Mapping[str, str] = metadata.get("labels") or {}
    config = proxy_config(values, annotations, str(metadata.get("namespace") or ""), labels_in, configs, root_namespace,
                          mesh_default)
    mode = annotations.get(INTERCEPTION_MODE, config.get("interceptionMode", "REDIRECT"))
    tproxy = mode == "TPROXY"
    native = g["nativeSidecar"] is True
    if NATIVE_SIDECAR in annotations:
        native = _go_bool(annotations[NATIVE_SIDECAR], NATIVE_SIDECAR)
    hold = bool(config.get("holdApplicationUntilProxyStarts") or proxy["holdApplicationUntilProxyStarts"]) and not native
    cni = bool(values["istio_cni"].get("enabled") or (values.get("pilot") or {}).get("cni", {}).get("enabled"))
    status_port = str(annotations.get(STATUS_PORT, proxy["statusPort"]))
    app = [c for c in spec.get("containers") or [] if c.get("name") != PROXY]
    app_names = [str(c.get("name", "")) for c in app]

    def traffic(annotation: str, value: str) -> str:
        return str(annotations.get(f"traffic.sidecar.istio.io/{annotation}", proxy[value]))

    include_ranges, exclude_ranges = traffic("includeOutboundIPRanges", "includeIPRanges"), traffic(
        "excludeOutboundIPRanges", "excludeIPRanges")
    include_inbound = traffic("includeInboundPorts", "includeInboundPorts")
    exclude_inbound = _excluded_inbound(status_port, traffic("excludeInboundPorts", "excludeInboundPorts"))
    include_outbound_ports = traffic("includeOutboundPorts", "includeOutboundPorts")
    exclude_outbound_ports = traffic("excludeOutboundPorts", "excludeOutboundPorts")
    agent_log_level = annotations.get("sidecar.istio.io/agentLogLevel", g["logging"]["level"])

    out_annotations: dict[str, str] = {"istio.io/rev": revision}
    for key in ("kubectl.kubernetes.io/default-logs-container", "kubectl.kubernetes.io/default-container"):
        if app_names and key not in annotations:
            out_annotations[key] = app_names[0]
    if cni:  # what the CNI plugin reads to capture
        pilot_cni = (values.get("pilot") or {}).get("cni") or {}
        if pilot_cni.get("provider") == "multus":
            networks = annotations.get("k8s.v1.cni.cncf.io/networks", "")
            out_annotations["k8s.v1.cni.cncf.io/networks"] = networks if "istio-cni" in networks \
                else ", ".join(filter(None, [networks, "default/istio-cni"]))
        out_annotations[INTERCEPTION_MODE] = mode
        if include_ranges:
            out_annotations["traffic.sidecar.istio.io/includeOutboundIPRanges"] = include_ranges
        if exclude_ranges:
            out_annotations["traffic.sidecar.istio.io/excludeOutboundIPRanges"] = exclude_ranges
        out_annotations["traffic.sidecar.istio.io/includeInboundPorts"] = include_inbound
        out_annotations["traffic.sidecar.istio.io/excludeInboundPorts"] = exclude_inbound
        if include_outbound_ports:
            out_annotations["traffic.sidecar.istio.io/includeOutboundPorts"] = include_outbound_ports
        if exclude_outbound_ports:
            out_annotations["traffic.sidecar.istio.io/excludeOutboundPorts"] = exclude_outbound_ports
        for key in ("traffic.sidecar.istio.io/kubevirtInterfaces", "istio.io/reroute-virtual-interfaces",
                    "traffic.sidecar.istio.io/excludeInterfaces"):
            if annotations.get(key):
                out_annotations[key] = annotations[key]
    out_annotations.update(_prometheus(values, annotations, status_port))

    out_labels = {
        "security.istio.io/tlsMode": labels_in.get("security.istio.io/tlsMode", "istio"),
        "service.istio.io/canonical-name": labels_in.get("service.istio.io/canonical-name")
        or labels_in.get("app.kubernetes.io/name") or labels_in.get("app") or _workload(metadata)[0],
        "service.istio.io/canonical-revision": labels_in.get("service.istio.io/canonical-revision")
        or labels_in.get("app.kubernetes.io/version") or labels_in.get("version") or "latest",
    }

    if str((config.get("proxyMetadata") or {}).get("ISTIO_META_ENABLE_HBONE")) == "true":
        out_labels["networking.istio.io/tunnel"] = labels_in.get("networking.istio.io/tunnel", "http")

    init_containers: list[dict[str, Any]] = []
    resources = _resources(values, annotations)
    if mode != "NONE":
        args = ["istio-iptables", "-p", str(config.get("proxyListenPort") or 15001),
                "-z", str(config.get("proxyInboundListenPort") or 15006), "-u", str(PROXY_UID), "-m", mode,
                "-i", include_ranges, "-x", exclude_ranges, "-b", include_inbound,
                "-d", f"15090,15021,{exclude_inbound}" if status_port != "0" else "15090,15021"]
        if include_outbound_ports:
            args += ["-q", include_outbound_ports]
        if exclude_outbound_ports:
            args += ["-o", exclude_outbound_ports]
        for annotation in ("istio.io/reroute-virtual-interfaces", "traffic.sidecar.istio.io/kubevirtInterfaces"):
            if annotation in annotations:
                args += ["-k", annotations[annotation]]
                break
        if "traffic.sidecar.istio.io/excludeInterfaces" in annotations:
            args += ["-c", annotations["traffic.sidecar.istio.io/excludeInterfaces"]]
        args.append(f"--log_output_level={agent_log_level}")
        if g["logAsJson"]:
            args.append("--log_as_json")
        if cni:
            args += ["--run-validation", "--skip-rule-apply"]
        elif g.get("proxy_init", {}).get("forceApplyIptables"):
            args.append("--force-apply")
        if g.get("nativeNftables"):
            args.append("--native-nftables")
        init = {
            "name": VALIDATION if cni else INIT,
            "image": annotations.get("sidecar.istio.io/proxyImage", _image(values, g["proxy_init"]["image"])),
            "args": args,
            **({"env": [{"name": k, "value": str(v)} for k, v in config["proxyMetadata"].items()]}
               if config.get("proxyMetadata") else {}),
            "resources": copy.deepcopy(resources),
            "securityContext": {
                "allowPrivilegeEscalation": bool(proxy["privileged"]), "privileged": bool(proxy["privileged"]),
                "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True,
                "runAsGroup": PROXY_UID, "runAsUser": PROXY_UID, "runAsNonRoot": True,
            } if cni else {
                "allowPrivilegeEscalation": bool(proxy["privileged"]), "privileged": bool(proxy["privileged"]),
                "capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]},
                "readOnlyRootFilesystem": False, "runAsGroup": 0, "runAsNonRoot": False, "runAsUser": 0,
            },
        }
        if g["imagePullPolicy"]:
            init["imagePullPolicy"] = g["imagePullPolicy"]
        init_containers.append(init)

    rewrite = bool(values["sidecarInjectorWebhook"].get("rewriteAppHTTPProbe"))
    if REWRITE_PROBES in annotations:
        rewrite = _go_bool(annotations[REWRITE_PROBES], REWRITE_PROBES)
    status = int(status_port)
    all_app = list(spec.get("initContainers") or []) + app
    probers = app_probers(all_app, status) if rewrite and status else ""
    sidecar = _proxy_container(values, config, annotations, pod, app_names, probers, resources, native, hold,
                               tproxy, status_port, mode)
    last: list[dict[str, Any]] = []
    if native:
        init_containers.append(sidecar)
    elif init_containers and init_containers[0]["name"] == INIT:
        last = [init_containers.pop()]
    app_containers = [rewrite_probes(c, status) if probers else copy.deepcopy(c) for c in spec.get("containers") or []]
    app_inits = [rewrite_probes(c, status) if probers else copy.deepcopy(c) for c in spec.get("initContainers") or []]
    return Layout(init_containers, last, [] if native else [sidecar], hold, _volumes(values), app_containers,
                  app_inits, out_labels, out_annotations)


# The API group of the workload kinds Istio names a pod's owner by (ISTIO_META_OWNER).
_OWNER_API = {"Deployment": "apps/v1", "StatefulSet": "apps/v1", "DaemonSet": "apps/v1", "ReplicaSet": "apps/v1",
              "Job": "batch/v1", "CronJob": "batch/v1", "Pod": "v1"}


def _workload(metadata: Mapping[str, Any]) -> tuple[str, str, str]:
    """(name, kind, apiVersion) of the pod's workload by Istio's rules (ReplicaSet -> Deployment,
    a CronJob's Job -> CronJob, the workload-name label first)."""
    labels = {str(k): str(v) for k, v in (metadata.get("labels") or {}).items()}
    owners = [OwnerRef(str(o.get("kind", "")), str(o.get("name", "")), bool(o.get("controller")))
              for o in metadata.get("ownerReferences") or [] if isinstance(o, dict)]
    name, kind = workload_identity(str(metadata.get("name") or metadata.get("generateName") or ""), labels, owners)
    api = _OWNER_API.get(kind) or next((str(o.get("apiVersion", "")) for o in metadata.get("ownerReferences") or []
                                         if isinstance(o, dict) and o.get("kind") == kind), "v1")
    return name, kind, api


def _proxy_container(values: Mapping[str, Any], config: Mapping[str, Any], annotations: Mapping[str, str],
                     pod: Mapping[str, Any], app_names: list[str], probers: str, resources: dict[str, Any],
                     native: bool, hold: bool, tproxy: bool, status_port: str, mode: str) -> dict[str, Any]:
    g, proxy = values["global"], values["global"]["proxy"]
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    namespace = g["istioNamespace"]
    trust_domain = values["meshConfig"].get("trustDomain") or g.get("trustDomain") or ""
    ports = [p for c in spec.get("containers") or [] for p in c.get("ports") or []]
    args = ["proxy", "sidecar", "--domain", f"$(POD_NAMESPACE).svc.{proxy['clusterDomain']}",
            f"--proxyLogLevel={annotations.get('sidecar.istio.io/logLevel', proxy['logLevel'])}",
            f"--proxyComponentLogLevel={annotations.get('sidecar.istio.io/componentLogLevel', proxy['componentLogLevel'])}",
            f"--log_output_level={annotations.get('sidecar.istio.io/agentLogLevel', g['logging']['level'])}"]
    if g["sts"]["servicePort"]:
        args.append(f"--stsPort={g['sts']['servicePort']}")
    if g["logAsJson"]:
        args.append("--log_as_json")
    if proxy["outlierLogPath"]:
        args.append(f"--outlierLogPath={proxy['outlierLogPath']}")
    env: list[dict[str, Any]] = [
        {"name": "PILOT_CERT_PROVIDER", "value": g["pilotCertProvider"]},
        {"name": "CA_ADDR", "value": g["caAddress"] or f"{service_name(str(values.get('revision') or ''))}.{namespace}.svc:15012"},
        {"name": "POD_NAME", **_field("metadata.name")},
        {"name": "POD_NAMESPACE", **_field("metadata.namespace")},
        {"name": "INSTANCE_IP", **_field("status.podIP")},
        {"name": "SERVICE_ACCOUNT", **_field("spec.serviceAccountName")},
        {"name": "HOST_IP", **_field("status.hostIP")},
        {"name": "ISTIO_CPU_LIMIT", **_resource("limits.cpu")},
        {"name": "PROXY_CONFIG", "value": json.dumps(config, separators=(",", ":"), sort_keys=True)},
        {"name": "ISTIO_META_POD_PORTS", "value": json.dumps(ports, separators=(",", ":"))},
        {"name": "ISTIO_META_APP_CONTAINERS", "value": ",".join(app_names)},
        {"name": "GOMEMLIMIT", **_resource("limits.memory")},
        {"name": "GOMAXPROCS", **_resource("limits.cpu")},
        {"name": "ISTIO_META_CLUSTER_ID", "value": g["multiCluster"].get("clusterName") or "Kubernetes"},
        {"name": "ISTIO_META_NODE_NAME", **_field("spec.nodeName")},
        {"name": "ISTIO_META_INTERCEPTION_MODE", "value": mode},
    ]
    if str((values["meshConfig"].get("inboundTrafficPolicy") or {}).get("mode", "")).upper() == "LOCALHOST":
        env.insert(0, {"name": "REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION", "value": "true"})
    # The pod's topology.istio.io/network label wins over values.global.network, as in istiod.
    network = (metadata.get("labels") or {}).get("topology.istio.io/network", g["network"])
    if network:
        env.append({"name": "ISTIO_META_NETWORK", "value": network})
    workload, kind, api = _workload(metadata)
    if workload:
        env.append({"name": "ISTIO_META_WORKLOAD_NAME", "value": workload})
        env.append({"name": "ISTIO_META_OWNER", "value": f"kubernetes://apis/{api}/namespaces/"
                    f"{metadata.get('namespace') or 'default'}/{kind.lower()}s/{workload}"})
    if g["meshID"] or trust_domain:
        env.append({"name": "ISTIO_META_MESH_ID", "value": g["meshID"] or trust_domain})
    if trust_domain:
        env.append({"name": "TRUST_DOMAIN", "value": trust_domain})
    if probers:
        env.append({"name": "ISTIO_KUBE_APP_PROBERS", "value": probers})
    env += [{"name": k, "value": str(v)} for k, v in (config.get("proxyMetadata") or {}).items()]
    container: dict[str, Any] = {
        "name": PROXY,
        "image": annotations.get("sidecar.istio.io/proxyImage", _image(values, proxy["image"])),
        "ports": [{"containerPort": 15090, "protocol": "TCP", "name": "http-envoy-prom"}],
        "args": args,
    }
    if native:
        container["restartPolicy"] = "Always"
    if proxy.get("lifecycle"):
        container["lifecycle"] = copy.deepcopy(proxy["lifecycle"])
    elif hold:
        container["lifecycle"] = {"postStart": {"exec": {"command": ["pilot-agent", "wait"]}}}
    elif native:  # drain when the pod's shutdown starts; SIGTERM comes once the apps are gone
        container["lifecycle"] = {"preStop": {"exec": {"command": [
            "pilot-agent", "request", f"--debug-port={status_port}", "POST", "drain"]}}}
    container["env"] = env
    if g["imagePullPolicy"]:
        container["imagePullPolicy"] = g["imagePullPolicy"]
    if status_port != "0":
        ready = {"httpGet": {"path": "/healthz/ready", "port": 15021}}
        if proxy["startupProbe"]["enabled"]:
            container["startupProbe"] = {**ready, "periodSeconds": 1, "timeoutSeconds": 3,
                                         "failureThreshold": proxy["startupProbe"]["failureThreshold"]}
        container["readinessProbe"] = {
            **copy.deepcopy(ready),
            "initialDelaySeconds": int(annotations.get("readiness.status.sidecar.istio.io/initialDelaySeconds",
                                                       proxy["readinessInitialDelaySeconds"])),
            "periodSeconds": int(annotations.get("readiness.status.sidecar.istio.io/periodSeconds",
                                                 proxy["readinessPeriodSeconds"])),
            "timeoutSeconds": 3,
            "failureThreshold": int(annotations.get("readiness.status.sidecar.istio.io/failureThreshold",
                                                    proxy["readinessFailureThreshold"])),
        }
        # zeros left out, as the API (and Istio's patch) leaves out Go's zero values
        container["readinessProbe"] = {k: v for k, v in container["readinessProbe"].items() if v != 0}
    container["securityContext"] = {
        "allowPrivilegeEscalation": bool(proxy["privileged"]),
        "capabilities": {**({"add": ["NET_ADMIN"]} if tproxy else {}), "drop": ["ALL"]},
        "privileged": bool(proxy["privileged"]), "readOnlyRootFilesystem": True,
        **({"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": PROXY_UID} if tproxy else
           {"runAsNonRoot": True, "runAsUser": PROXY_UID, "runAsGroup": PROXY_UID}),
    }
    container["resources"] = resources
    mounts = [{"name": "workload-socket", "mountPath": "/var/run/secrets/workload-spiffe-uds"},
              {"name": "credential-socket", "mountPath": "/var/run/secrets/credential-uds"},
              {"name": "workload-certs", "mountPath": "/var/run/secrets/workload-spiffe-credentials"}]
    if g["pilotCertProvider"] == "istiod":
        mounts.append({"mountPath": "/var/run/secrets/istio", "name": "istiod-ca-cert"})
    mounts += [{"mountPath": "/var/run/secrets/istio/crl", "name": "istio-ca-crl"},
               {"mountPath": "/var/lib/istio/data", "name": "istio-data"},
               {"mountPath": "/etc/istio/proxy", "name": "istio-envoy"},
               {"mountPath": "/var/run/secrets/tokens", "name": "istio-token"},
               {"name": "istio-podinfo", "mountPath": "/etc/istio/pod"}]
    container["volumeMounts"] = mounts
    return container


def _volumes(values: Mapping[str, Any]) -> list[dict[str, Any]]:
    g = values["global"]
    volumes: list[dict[str, Any]] = [
        {"emptyDir": {}, "name": "workload-socket"},
        {"emptyDir": {}, "name": "credential-socket"},
        {"emptyDir": {}, "name": "workload-certs"},
        {"emptyDir": {"medium": "Memory"}, "name": "istio-envoy"},
        {"name": "istio-data", "emptyDir": {}},
        {"name": "istio-podinfo", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]}},
        {"name": "istio-token", "projected": {"sources": [{"serviceAccountToken": {
            "path": "istio-token", "expirationSeconds": 43200, "audience": g["sds"]["token"]["aud"]}}]}},
    ]
    if g["pilotCertProvider"] == "istiod":
        volumes.append({"name": "istiod-ca-cert",
                        "configMap": {"name": g.get("trustBundleName") or "istio-ca-root-cert"}})
    volumes.append({"name": "istio-ca-crl",
                    "configMap": {"name": (values.get("pilot") or {}).get("crlConfigMapName") or "istio-ca-crl",
                                  "optional": True}})
    return volumes


def _prometheus(values: Mapping[str, Any], annotations: Mapping[str, str], status_port: str) -> dict[str, str]:
    """Istio's metrics merge: Prometheus scrapes the agent, which merges the app's metrics in. Only for
    pods without their own prometheus.io/port or /path (Istio then also tells the agent where the app's
    are, ISTIO_PROMETHEUS_ANNOTATIONS; not done here: such pods keep their annotations)."""
    enabled = values["meshConfig"].get("enablePrometheusMerge", True)
    if annotations.get("prometheus.istio.io/merge-metrics") is not None:
        enabled = _go_bool(annotations["prometheus.istio.io/merge-metrics"], "prometheus.istio.io/merge-metrics")
    if not enabled or annotations.get("prometheus.io/scrape", "true") != "true" or status_port == "0":
        return {}
    if "prometheus.io/port" in annotations or "prometheus.io/path" in annotations:
        return {}
    return {"prometheus.io/port": status_port, "prometheus.io/path": "/stats/prometheus", "prometheus.io/scrape": "true"}

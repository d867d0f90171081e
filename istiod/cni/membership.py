"""Which pods of a node are in the ambient mesh (Istio's PodRedirectionEnabled), from the store."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from istiod.model.workload import Workload

DATAPLANE_MODE_LABEL = "istio.io/dataplane-mode"
AMBIENT, NONE = "ambient", "none"
# What istio-cni writes on a pod it captured, and istiod reads to send the workload as HBONE.
REDIRECTION_ANNOTATION = "ambient.istio.io/redirection"
REDIRECTION_ENABLED = "enabled"
SIDECAR_STATUS_ANNOTATION = "sidecar.istio.io/status"  # the injector's mark: the pod has a sidecar

PodKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True, slots=True)
class NodePod:
    """A pod scheduled on this node, with what the agent needs of it."""

    uid: str  # the pod's UID; `namespace/name` when the object has none (a config-dir file)
    name: str
    namespace: str
    service_account: str
    ip: str
    ambient: bool
    annotated: bool  # carries `ambient.istio.io/redirection: enabled`

    @property
    def key(self) -> PodKey:
        return self.namespace, self.name


class _Stored(Protocol):
    @property
    def raw(self) -> Mapping[str, Any]: ...

    @property
    def value(self) -> Any: ...


class _Objects(Protocol):
    def objects(self, kind: str | None = None) -> Iterator[_Stored]: ...


def redirection_enabled(pod: Mapping[str, Any], labels: Mapping[str, str], namespace_labels: Mapping[str, str]) -> bool:
    """Istio's rules: the pod or its namespace asks for ambient, the pod does not opt out with
    `none`, it has no sidecar, and it is not on the host's network (its rules would be the host's)."""
    if AMBIENT not in (labels.get(DATAPLANE_MODE_LABEL), namespace_labels.get(DATAPLANE_MODE_LABEL)):
        return False
    if labels.get(DATAPLANE_MODE_LABEL) == NONE:
        return False
    if SIDECAR_STATUS_ANNOTATION in _annotations(pod):
        return False
    return not (pod.get("spec") or {}).get("hostNetwork", False)


def node_pods(objects: _Objects, node: str) -> dict[PodKey, NodePod]:
    """Every live pod the store has on `node`, ambient or not."""
    namespaces = {o.value.name: dict(o.value.labels) for o in objects.objects("Namespace")}
    pods = {}
    for stored in objects.objects("Pod"):
        workload: Workload = stored.value
        if workload.node_name != node or workload.terminal or (stored.raw.get("metadata") or {}).get("deletionTimestamp"):
            continue
        labels = workload.label_map()
        annotations = _annotations(stored.raw)
        pod = NodePod(
            uid=str((stored.raw.get("metadata") or {}).get("uid") or f"{workload.namespace}/{workload.name}"),
            name=workload.name,
            namespace=workload.namespace,
            service_account=workload.service_account,
            ip=workload.ip,
            ambient=redirection_enabled(stored.raw, labels, namespaces.get(workload.namespace, {})),
            annotated=annotations.get(REDIRECTION_ANNOTATION) == REDIRECTION_ENABLED,
        )
        pods[pod.key] = pod
    return pods


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    annotations = (pod.get("metadata") or {}).get("annotations")
    return annotations if isinstance(annotations, Mapping) else {}

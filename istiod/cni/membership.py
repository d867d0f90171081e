"""Which pods of a node are in the ambient mesh (Istio's PodRedirectionEnabled), from the store."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from istiod.model.workload import AMBIENT_REDIRECTION_ANNOTATION, SIDECAR_STATUS_ANNOTATION, Workload

DATAPLANE_MODE_LABEL = "istio.io/dataplane-mode"
AMBIENT, NONE = "ambient", "none"
REDIRECTION_ENABLED = "enabled"  # the value of AMBIENT_REDIRECTION_ANNOTATION istio-cni writes

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


def redirection_enabled(pod: Workload, namespace_labels: Mapping[str, str]) -> bool:
    """Istio's rules: the pod or its namespace asks for ambient, the pod does not opt out with
    `none`, it has no sidecar, and it is not on the host's network (its rules would be the host's)."""
    labels = pod.label_map()
    if AMBIENT not in (labels.get(DATAPLANE_MODE_LABEL), namespace_labels.get(DATAPLANE_MODE_LABEL)):
        return False
    if labels.get(DATAPLANE_MODE_LABEL) == NONE:
        return False
    return SIDECAR_STATUS_ANNOTATION not in dict(pod.annotations) and not pod.host_network


def node_pods(objects: _Objects, node: str) -> dict[PodKey, NodePod]:
    """Every live pod the store has on `node`, ambient or not."""
    namespaces = {o.value.name: dict(o.value.labels) for o in objects.objects("Namespace")}
    pods = {}
    for stored in objects.objects("Pod"):
        workload: Workload = stored.value
        if workload.node_name != node or workload.terminal or workload.terminating:
            continue
        pod = NodePod(
            # The model keeps no UID (istiod names workloads by namespace and name): read it here.
            uid=str((stored.raw.get("metadata") or {}).get("uid") or f"{workload.namespace}/{workload.name}"),
            name=workload.name,
            namespace=workload.namespace,
            service_account=workload.service_account,
            ip=workload.ip,
            ambient=redirection_enabled(workload, namespaces.get(workload.namespace, {})),
            annotated=dict(workload.annotations).get(AMBIENT_REDIRECTION_ANNOTATION) == REDIRECTION_ENABLED,
        )
        pods[pod.key] = pod
    return pods

"""Workloads (pods) and Istio's rules for naming them from their owners."""

from __future__ import annotations

import re
from dataclasses import dataclass

from istiod.model.service import Locality

WORKLOAD_NAME_LABEL = "service.istio.io/workload-name"
LOCALITY_LABEL = "istio-locality"
# The Pod annotations the mesh reads (only these are kept, so others changing push nothing): istio-cni's
# mark that it redirects the pod's traffic to ztunnel, and the injector's mark of a sidecar.
AMBIENT_REDIRECTION_ANNOTATION = "ambient.istio.io/redirection"
SIDECAR_STATUS_ANNOTATION = "sidecar.istio.io/status"
MESH_ANNOTATIONS = (AMBIENT_REDIRECTION_ANNOTATION, SIDECAR_STATUS_ANNOTATION)
# Istio treats a Job named `<cron>-<8..10 digits>` as made by CronJob `<cron>` (the digits are the
# scheduled time in minutes), so no owner needs to be fetched.
_CRONJOB_JOB_NAME = re.compile(r"(.+)-\d{8,10}")


@dataclass(frozen=True, slots=True)
class OwnerRef:
    kind: str
    name: str
    controller: bool = False


@dataclass(frozen=True, slots=True)
class Workload:
    """A Pod as the mesh sees it."""

    name: str  # the pod's name
    namespace: str
    ip: str
    ready: bool
    phase: str
    labels: tuple[tuple[str, str], ...]
    service_account: str
    workload_name: str
    workload_kind: str
    node_name: str = ""
    uid: str = ""  # metadata.uid: tells a pod from one recreated under its name
    owner: OwnerRef | None = None
    claims: tuple[str, ...] = ()  # names of PersistentVolumeClaims it mounts
    container_ports: tuple[tuple[str, int], ...] = ()  # (name, containerPort)
    locality_label: str = ""
    annotations: tuple[tuple[str, str], ...] = ()  # those of MESH_ANNOTATIONS it has
    host_network: bool = False
    terminating: bool = False  # it has a deletionTimestamp

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    def label_map(self) -> dict[str, str]:
        return dict(self.labels)

    def container_port(self, target: int | str) -> int | None:
        if isinstance(target, int):
            return target
        return next((number for name, number in self.container_ports if name == target), None)

    def locality(self, node_locality: Locality | None) -> Locality:
        if self.locality_label:
            return Locality.parse(self.locality_label)
        return node_locality or Locality()


def workload_identity(
    pod_name: str, labels: dict[str, str], owners: list[OwnerRef]
) -> tuple[str, str]:
    """(workload name, kind) by Istio's rules, from the pod alone."""
    controller = next((o for o in owners if o.controller), None)
    if WORKLOAD_NAME_LABEL in labels:
        return labels[WORKLOAD_NAME_LABEL], controller.kind if controller else "Pod"
    if controller is None:
        return pod_name, "Pod"
    if controller.kind == "ReplicaSet":
        template_hash = labels.get("pod-template-hash", "")
        if template_hash and controller.name.endswith("-" + template_hash):
            return controller.name[: -len(template_hash) - 1], "Deployment"
    if controller.kind == "Job":
        cron = _CRONJOB_JOB_NAME.fullmatch(controller.name)
        if cron:
            return cron.group(1), "CronJob"
    return controller.name, controller.kind

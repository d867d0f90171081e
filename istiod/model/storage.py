"""Storage facts: PersistentVolumes, their claims, and which workloads mount them."""

from __future__ import annotations

from dataclasses import dataclass

from istiod.model.quantity import Quantity


@dataclass(frozen=True, slots=True)
class PersistentVolume:
    name: str
    capacity: Quantity | None
    access_modes: tuple[str, ...]
    claim: tuple[str, str] | None  # (namespace, name) from spec.claimRef
    storage_class: str = ""
    phase: str = ""


@dataclass(frozen=True, slots=True)
class PersistentVolumeClaim:
    name: str
    namespace: str
    volume_name: str
    requested: Quantity | None
    access_modes: tuple[str, ...] = ()

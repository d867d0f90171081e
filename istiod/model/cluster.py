"""Cluster-scoped facts the mesh reads: namespaces and nodes."""

from __future__ import annotations

from dataclasses import dataclass

from istiod.model.service import Locality


@dataclass(frozen=True, slots=True)
class Namespace:
    name: str
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    locality: Locality

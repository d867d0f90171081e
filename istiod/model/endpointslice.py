"""EndpointSlices as the mesh reads them: which addresses serve which named ports of a Service."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SliceEndpoint:
    addresses: tuple[str, ...]
    ready: bool
    pod: str = ""  # targetRef name when it is a Pod
    node_name: str = ""
    zone: str = ""


@dataclass(frozen=True, slots=True)
class EndpointSlice:
    name: str
    namespace: str
    service: str  # the kubernetes.io/service-name label
    ports: tuple[tuple[str, int], ...]  # (port name, port number)
    endpoints: tuple[SliceEndpoint, ...]

"""The pod annotations istiod's injector checks before injecting (Istio's pkg/kube/inject/validate.go),
with its rules and messages: a value the capture or the probes could not use refuses the pod at
admission, instead of an init container that fails on every start."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping

_DIGITS = re.compile(r"[0-9]+")
_GO_BOOLS = frozenset({"1", "t", "T", "TRUE", "true", "True", "0", "f", "F", "FALSE", "false", "False"})


def _uint(text: str, bits: int) -> int:
    """Go's strconv.ParseUint(text, 10, bits)."""
    if not _DIGITS.fullmatch(text):
        raise ValueError(f"parsing {text!r}: invalid syntax")
    value = int(text)
    if value >= 1 << bits:
        raise ValueError(f"parsing {text!r}: value out of range")
    return value


def _port_list(name: str, ports: str) -> None:
    for port in ports.strip().split(",") if ports.strip() else ():
        try:
            _uint(port.strip(), 16)
        except ValueError as error:
            raise ValueError(f"{name} invalid: failed parsing port '{port}': {error}") from None


def _cidr_list(name: str, cidrs: str) -> None:
    """Each item as Go's netip.ParsePrefix reads it: an address, a slash and a prefix length, no spaces."""
    for cidr in cidrs.split(",") if cidrs else ():
        address, slash, bits = cidr.partition("/")
        try:
            if not slash:
                raise ValueError("no '/'")
            if "%" in address:
                raise ValueError("IPv6 zones cannot be present in a prefix")
            try:
                ip = ipaddress.ip_address(address)
            except ValueError:
                raise ValueError(f"{address!r} is not an IP address") from None
            if not _DIGITS.fullmatch(bits) or len(bits) > 1 and bits.startswith("0"):
                raise ValueError(f"bad bits after slash: {bits!r}")
            if int(bits) > ip.max_prefixlen:
                raise ValueError("prefix length out of range")
        except ValueError as error:
            raise ValueError(f"{name} invalid: failed parsing cidr '{cidr}': {error}") from None


def _interception_mode(mode: str) -> None:
    if mode not in ("REDIRECT", "TPROXY", "NONE"):
        raise ValueError(f"interceptionMode invalid, use REDIRECT,TPROXY,NONE: {mode}")


def _status_port(port: str) -> None:
    try:
        _uint(port.strip(), 16)
    except ValueError as error:  # istiod's message names the wrong parameter; kept, as the text users search for
        raise ValueError(f"excludeInboundPorts invalid: failed parsing port '{port}': {error}") from None


def _uint32(value: str) -> None:
    _uint(value, 32)


def _bool(value: str) -> None:
    if value not in _GO_BOOLS:
        raise ValueError(f"parsing {value!r}: invalid syntax")


def _include(check: Callable[[str], None]) -> Callable[[str], None]:
    """`*` (everything) or what `check` accepts."""
    return lambda value: None if value == "*" else check(value)


CHECKS: Mapping[str, Callable[[str], None]] = {
    "sidecar.istio.io/interceptionMode": _interception_mode,
    "status.sidecar.istio.io/port": _status_port,
    "readiness.status.sidecar.istio.io/initialDelaySeconds": _uint32,
    "readiness.status.sidecar.istio.io/periodSeconds": _uint32,
    "readiness.status.sidecar.istio.io/failureThreshold": _uint32,
    "traffic.sidecar.istio.io/includeOutboundIPRanges": _include(lambda v: _cidr_list("includeIPRanges", v)),
    "traffic.sidecar.istio.io/excludeOutboundIPRanges": lambda v: _cidr_list("excludeIPRanges", v),
    "traffic.sidecar.istio.io/includeInboundPorts": _include(lambda v: _port_list("includeInboundPorts", v)),
    "traffic.sidecar.istio.io/excludeInboundPorts": lambda v: _port_list("excludeInboundPorts", v),
    "traffic.sidecar.istio.io/excludeOutboundPorts": lambda v: _port_list("excludeOutboundPorts", v),
    "prometheus.istio.io/merge-metrics": _bool,
}


def annotation_errors(annotations: Mapping[str, str]) -> list[str]:
    """istiod's validateAnnotations: one message per annotation whose value is refused, in name order."""
    errors = []
    for name, value in sorted(annotations.items()):
        check = CHECKS.get(name)
        if check is None:
            continue
        try:
            check(value)
        except ValueError as error:
            errors.append(f"invalid value '{value}' for annotation '{name}': {error}")
    return errors

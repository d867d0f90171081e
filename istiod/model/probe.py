"""Istio's ReadinessProbe (a WorkloadGroup's `probe`, a ProxyConfig's `readinessProbe`): read and
checked as Istio's validateReadinessProbe does, with the defaults pilot-agent fills in. Pure: a map
in, a frozen value out; ProbeError's message names the field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_FIELDS = ("initialDelaySeconds", "timeoutSeconds", "periodSeconds", "successThreshold", "failureThreshold",
           "httpGet", "tcpSocket", "exec", "grpc")
_HEADER_NAME = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class ProbeError(ValueError):
    """A probe Istio's validation refuses; the message names the field."""


@dataclass(frozen=True, slots=True)
class HttpGet:
    port: int
    path: str = "/"
    host: str = ""  # "": the workload's own address
    scheme: str = "http"
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class TcpSocket:
    port: int
    host: str = ""


@dataclass(frozen=True, slots=True)
class Exec:
    command: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReadinessProbe:
    method: HttpGet | TcpSocket | Exec
    initial_delay: int = 0  # seconds
    timeout: int = 1
    period: int = 10
    success_threshold: int = 1
    failure_threshold: int = 1


def _count(probe: Mapping[str, Any], name: str) -> int:
    value = probe.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProbeError(f"{name}: {value!r} is not an integer")
    if value < 0:
        raise ProbeError(f"{name} must be non-negative")
    return value


def _port(method: str, body: Mapping[str, Any]) -> int:
    port = body.get("port")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ProbeError(f"{method}.port: port number {port} must be in the range 1..65535")
    return port


def _str(body: Mapping[str, Any], path: str, name: str, default: str = "") -> str:
    value = body.get(name)
    if value is None or value == "":
        return default
    if not isinstance(value, str):
        raise ProbeError(f"{path}.{name}: expected a string, got {type(value).__name__}")
    return value


def _map(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProbeError(f"{name} may not be nil" if value is None else f"{name}: expected a map")
    return value


def _http_get(body: Mapping[str, Any]) -> HttpGet:
    unknown = set(body) - {"path", "port", "host", "scheme", "httpHeaders"}
    if unknown:
        raise ProbeError(f"httpGet: unknown field {sorted(map(str, unknown))[0]!r}")
    port = _port("httpGet", body)
    scheme = _str(body, "httpGet", "scheme", "HTTP")
    if scheme not in ("HTTP", "HTTPS"):
        raise ProbeError('httpGet.scheme must be one of "HTTPS", "HTTP"')
    headers = []
    headers_list = body.get("httpHeaders") or []
    if not isinstance(headers_list, list):
        raise ProbeError("httpGet.httpHeaders: expected a list")
    for i, header in enumerate(headers_list):
        if not isinstance(header, Mapping):
            raise ProbeError(f"httpGet.httpHeaders[{i}]: invalid nil header")
        name = _str(header, f"httpGet.httpHeaders[{i}]", "name")
        if not name or not set(name) <= _HEADER_NAME:
            raise ProbeError(f"httpGet.httpHeaders[{i}]: invalid probe header name: {name!r}")
        headers.append((name, _str(header, f"httpGet.httpHeaders[{i}]", "value")))
    return HttpGet(port, _str(body, "httpGet", "path", "/"), _str(body, "httpGet", "host"), scheme.lower(),
                   tuple(headers))


def parse_readiness_probe(probe: Mapping[str, Any]) -> ReadinessProbe:
    unknown = set(probe) - set(_FIELDS)
    if unknown:
        raise ProbeError(f"unknown field {sorted(map(str, unknown))[0]!r}")
    counts = {name: _count(probe, name) for name in _FIELDS[:5]}
    methods = [name for name in ("httpGet", "tcpSocket", "exec", "grpc") if name in probe]
    if len(methods) != 1:
        raise ProbeError("exactly one of httpGet, tcpSocket or exec is required" if not methods
                         else f"only one health check method may be set, not {' and '.join(methods)}")
    name = methods[0]
    body = _map(probe[name], name)
    method: HttpGet | TcpSocket | Exec
    if name == "httpGet":
        method = _http_get(body)
    elif name == "tcpSocket":
        if set(body) - {"host", "port"}:
            raise ProbeError(f"tcpSocket: unknown field {sorted(map(str, set(body) - {'host', 'port'}))[0]!r}")
        method = TcpSocket(_port("tcpSocket", body), _str(body, "tcpSocket", "host"))
    elif name == "exec":
        command = body.get("command") or []
        if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
            raise ProbeError("exec.command is required (a list of strings)")
        method = Exec(tuple(command))
    else:  # Istio's API has it; its validation refuses it
        raise ProbeError("grpc: unknown health check method (Istio's validation takes httpGet, tcpSocket or exec)")
    # pilot-agent's defaults: thresholds and the timeout at least 1, a period of 10 s.
    return ReadinessProbe(method, counts["initialDelaySeconds"], counts["timeoutSeconds"] or 1,
                          counts["periodSeconds"] or 10, counts["successThreshold"] or 1,
                          counts["failureThreshold"] or 1)

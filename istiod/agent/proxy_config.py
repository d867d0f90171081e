"""The proxy's ProxyConfig as the agent reads it: PROXY_CONFIG (JSON, or YAML), which the injector
fills with the merged meshConfig.defaultConfig, ProxyConfig objects and `proxy.istio.io/config`
annotation, as pilot-agent's ConstructProxyConfig reads it. Pure: text in, the fields that apply to
Envoy out, checked with Istio's messages (ValidateMeshConfigProxyConfig)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from istiod.durations import parse_duration
from istiod.model.probe import ProbeError, ReadinessProbe, parse_readiness_probe

# What the agent applies to Envoy and itself.
APPLIED = ("concurrency", "drainDuration", "terminationDrainDuration", "proxyMetadata", "statusPort",
           "proxyStatsMatcher", "readinessProbe")
# What injection applies (the pod's layout), or is where this agent takes it from elsewhere.
ELSEWHERE = ("holdApplicationUntilProxyStarts", "image", "interceptionMode", "discoveryAddress")


@dataclass(frozen=True, slots=True)
class AgentProxyConfig:
    """None: the field is not set; the agent's flag or default applies."""

    concurrency: int | None = None  # Envoy's worker threads; 0: one per CPU (no --concurrency)
    drain_duration: float | None = None  # Envoy's --drain-time-s
    termination_drain_duration: float | None = None  # after SIGTERM, draining before Envoy is stopped
    proxy_metadata: tuple[tuple[str, str], ...] = ()  # the agent's environment, as pilot-agent sets them
    status_port: int | None = None
    stats_matcher: Mapping[str, tuple[str, ...]] | None = None  # inclusionPrefixes/Suffixes/Regexps
    readiness_probe: ReadinessProbe | None = None  # the workload's (a VM's), whose result istiod is told
    as_read: Mapping[str, Any] | None = None  # the whole ProxyConfig, sent to istiod as node metadata PROXY_CONFIG
    ignored: tuple[str, ...] = ()  # the fields set that this agent does not apply (logged by the caller)


class ProxyConfigError(ValueError):
    """PROXY_CONFIG is not a ProxyConfig this agent can apply, in one line."""


def _duration(config: Mapping[str, Any], name: str) -> float | None:
    value = config.get(name)
    if value is None:
        return None
    try:
        return parse_duration(str(value))
    except argparse.ArgumentTypeError as error:
        raise ProxyConfigError(f"PROXY_CONFIG {name}: {error}") from None


def _drain_duration(config: Mapping[str, Any]) -> float | None:
    """Istio's ValidateDrainDuration."""
    seconds = _duration(config, "drainDuration")
    if seconds is None:
        return None
    if seconds < 0.001:
        raise ProxyConfigError("PROXY_CONFIG drainDuration: invalid drain duration: duration must be greater than 1ms")
    if seconds != int(seconds):
        raise ProxyConfigError("PROXY_CONFIG drainDuration: drain time only supports durations to seconds precision")
    return seconds


def _strings(config: Mapping[str, Any], path: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProxyConfigError(f"PROXY_CONFIG {path}: a list of strings")
    return tuple(value)


def parse_proxy_config(text: str) -> AgentProxyConfig:
    """PROXY_CONFIG's text; ProxyConfigError names the field."""
    if not text.strip():
        return AgentProxyConfig()
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ProxyConfigError(f"PROXY_CONFIG: not JSON or YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise ProxyConfigError("PROXY_CONFIG: not a ProxyConfig map")
    concurrency = config.get("concurrency")
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)):
        raise ProxyConfigError(f"PROXY_CONFIG concurrency: {concurrency!r} is not an integer")
    if concurrency is not None and concurrency < 0:
        raise ProxyConfigError("PROXY_CONFIG concurrency: concurrency must be greater than or equal to 0")
    metadata = config.get("proxyMetadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise ProxyConfigError("PROXY_CONFIG proxyMetadata: a map of names to strings")
    status_port = config.get("statusPort")
    if status_port is not None and (isinstance(status_port, bool) or not isinstance(status_port, int)
                                    or not 0 < status_port < 65536):
        raise ProxyConfigError(f"PROXY_CONFIG statusPort: invalid status port: port number {status_port} "
                               "must be in the range 1..65535")
    matcher = None
    if (stats := config.get("proxyStatsMatcher")) is not None:
        if not isinstance(stats, dict) or set(stats) - {"inclusionPrefixes", "inclusionSuffixes", "inclusionRegexps"}:
            raise ProxyConfigError("PROXY_CONFIG proxyStatsMatcher: a map of inclusionPrefixes, inclusionSuffixes "
                                   "and inclusionRegexps")
        matcher = {k: _strings(config, f"proxyStatsMatcher.{k}", v) for k, v in stats.items()}
    probe = None
    if (probe_body := config.get("readinessProbe")) is not None:
        if not isinstance(probe_body, dict):
            raise ProxyConfigError("PROXY_CONFIG readinessProbe: expected a map")
        try:
            probe = parse_readiness_probe(probe_body)
        except ProbeError as error:
            raise ProxyConfigError(f"PROXY_CONFIG readinessProbe: {error}") from None
    return AgentProxyConfig(
        concurrency=concurrency,
        readiness_probe=probe,
        as_read=config,
        drain_duration=_drain_duration(config),
        termination_drain_duration=_duration(config, "terminationDrainDuration"),
        proxy_metadata=tuple(sorted((k, str(v)) for k, v in metadata.items())),
        status_port=status_port,
        stats_matcher=matcher,
        ignored=tuple(sorted(set(config) - set(APPLIED) - set(ELSEWHERE))),
    )

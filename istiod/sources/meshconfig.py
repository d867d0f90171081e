"""The mesh config as istiod reads it: YAML from `--mesh-config FILE`, or in a cluster the
ConfigMap `istio` (key `mesh`, and key `meshNetworks` for the networks) in istiod's namespace;
changes apply without a restart.

Fields istiod has that this one does not implement are named in one warning line, not refused:
an Istio installation's ConfigMap carries many, and must still be read.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import ipaddress
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml
from kubernetes_asyncio import client

from istiod.model.config.networking import LocalityLbSetting
from istiod.model.names import DEFAULT_CLUSTER_ID
from istiod.durations import parse_duration
from istiod.envvars import resolve_hostname_gateways
from istiod.model.mesh import (
    AccessLogSettings, ExtAuthzProvider, MeshConfig, NetworkCidr, NetworkGateway, OutboundTrafficPolicy, ProxyConfig,
    RequestBody,
)
from istiod.sources.fields import ConversionError, _Fields
from istiod.sources.istio.common import dns1123_label, fields, fqdn_error, items, label_selector, only, port, str_list
from istiod.sources.istio.networking import locality_lb_setting
from istiod.sources.kube import Informer

log = logging.getLogger(__name__)
CONFIGMAP = "istio"
CONFIGMAP_KEY = "mesh"
T = TypeVar("T")
MESH_NETWORKS_KEY = "meshNetworks"  # istiod's MeshNetworks, beside the mesh config (kubemesh.MeshNetworksKey)
_FIELDS = ("trustDomain", "trustDomainAliases", "rootNamespace", "outboundTrafficPolicy", "enableAutoMtls", "defaultConfig",
           "discoverySelectors", "localityLbSetting", "extensionProviders", "protocolDetectionTimeout",
           "defaultServiceExportTo", "defaultVirtualServiceExportTo", "defaultDestinationRuleExportTo", "meshNetworks",
           "accessLogFile", "accessLogEncoding", "accessLogFormat")


class MeshConfigError(ValueError):
    pass


def _yaml_map(text: str, where: str) -> dict[str, Any]:
    try:
        body = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise MeshConfigError(f"{where}: {' '.join(str(error).split())}") from None
    if not isinstance(body, dict):
        raise MeshConfigError(f"{where}: expected a map")
    return body


def parse_mesh_config(text: str, base: MeshConfig, where: str) -> MeshConfig:
    """The YAML text over `base` (the flags' values); raises MeshConfigError naming the field."""
    f = _Fields(where, _yaml_map(text, where))
    try:
        return _parse(f, base)
    except ConversionError as error:
        raise MeshConfigError(str(error)) from None


def _parse(f: _Fields, base: MeshConfig) -> MeshConfig:
    ignored = sorted(set(f.body) - set(_FIELDS))
    proxy = base.default_config
    if (d := fields(f, "defaultConfig")) is not None:
        # Every field reaches injected pods (PROXY_CONFIG); the agent names those it does not apply.
        proxy = ProxyConfig(d.get("discoveryAddress", str, proxy.discovery_address), d.str_map("proxyMetadata"),
                            d.get("holdApplicationUntilProxyStarts", bool, proxy.hold_application_until_proxy_starts),
                            json.dumps(d.body, sort_keys=True, default=str))
    providers = base.extension_providers
    if "extensionProviders" in f.body:
        providers, unimplemented = _extension_providers(f)
        ignored += unimplemented
    if ignored:
        log.warning("%s: mesh config fields not implemented, ignored: %s", f.key, ", ".join(ignored))
    root = f.get("rootNamespace", str, base.root_namespace)
    if not dns1123_label(root):
        raise f.fail(f"rootNamespace: {root!r} is not a namespace name")
    policy = base.outbound_traffic_policy
    if (p := fields(f, "outboundTrafficPolicy")) is not None:
        only(p, ("mode",))
        mode = p.get("mode", str, "ALLOW_ANY")
        if mode not in OutboundTrafficPolicy.__members__:
            raise f.fail(f"outboundTrafficPolicy.mode: {mode!r} is not ALLOW_ANY or REGISTRY_ONLY")
        policy = OutboundTrafficPolicy(mode)
    selectors = base.discovery_selectors
    if "discoverySelectors" in f.body:
        selectors = tuple(label_selector(s) for s in items(f, "discoverySelectors"))
    return _networks(f, base).apply(dataclasses.replace(
        base,
        trust_domain=f.get("trustDomain", str, base.trust_domain) or base.trust_domain,
        trust_domain_aliases=str_list(f, "trustDomainAliases") if "trustDomainAliases" in f.body
        else base.trust_domain_aliases,
        root_namespace=root,
        outbound_traffic_policy=policy,
        enable_auto_mtls=f.get("enableAutoMtls", bool, base.enable_auto_mtls),
        default_config=proxy,
        discovery_selectors=selectors,
        # Set, it replaces Istio's default `enabled: true`; `enabled: false` turns locality LB off.
        locality_lb_setting=_locality_lb_setting(f, base),
        extension_providers=providers,
        protocol_detection_timeout=_protocol_detection_timeout(f, base),
        access_log=_access_log(f, base),
        default_service_export_to=_default_export_to(f, "defaultServiceExportTo", base.default_service_export_to),
        default_virtual_service_export_to=_default_export_to(f, "defaultVirtualServiceExportTo",
                                                             base.default_virtual_service_export_to),
        default_destination_rule_export_to=_default_export_to(f, "defaultDestinationRuleExportTo",
                                                              base.default_destination_rule_export_to),
    ))


def _networks(f: _Fields, base: MeshConfig) -> MeshNetworks:
    if (mesh_networks := fields(f, "meshNetworks")) is None:
        return MeshNetworks.of(base)
    return _mesh_networks(mesh_networks)


@dataclasses.dataclass(frozen=True, slots=True)
class MeshNetworks:
    """istiod's MeshNetworks, as MeshConfig's fields hold it."""

    network_gateways: tuple[NetworkGateway, ...] = ()
    registry_network: str = ""
    network_cidrs: tuple[NetworkCidr, ...] = ()

    def apply(self, mesh: MeshConfig) -> MeshConfig:
        return dataclasses.replace(mesh, network_gateways=self.network_gateways, registry_network=self.registry_network,
                                   network_cidrs=self.network_cidrs)

    @classmethod
    def of(cls, mesh: MeshConfig) -> MeshNetworks:
        return cls(mesh.network_gateways, mesh.registry_network, mesh.network_cidrs)


def parse_mesh_networks(text: str, where: str) -> MeshNetworks:
    """istiod's MeshNetworks YAML (`networks: ...`, the ConfigMap's key `meshNetworks`); raises
    MeshConfigError naming the field."""
    try:
        return _mesh_networks(_Fields(where, _yaml_map(text, where)))
    except ConversionError as error:
        raise MeshConfigError(str(error)) from None


def _mesh_networks(mesh_networks: _Fields) -> MeshNetworks:
    """meshNetworks' gateways by IP address, and the networks of endpoints without one of their own
    (`fromRegistry` naming our cluster ID, `fromCidr`). A gateway's registryServiceName is refused."""
    only(mesh_networks, ("networks",))
    gateways, cidrs, registry = [], [], []
    for name, body in sorted(mesh_networks.get("networks", dict, {}).items()):
        if not isinstance(body, dict):
            raise mesh_networks.fail(f"networks.{name}: expected a map")
        network = _Fields(f"{mesh_networks.key}.networks.{name}", body)
        only(network, ("gateways", "endpoints"))
        for endpoints in items(network, "endpoints"):
            only(endpoints, ("fromCidr", "fromRegistry"))
            if "fromCidr" in endpoints.body:
                cidr = endpoints.get("fromCidr", str, "")
                try:
                    ipaddress.ip_network(cidr, strict=False)
                except ValueError:
                    raise endpoints.fail(f"invalid network {name}: {cidr} is not a valid CIDR block") from None
                cidrs.append(NetworkCidr(str(name), cidr))
            if "fromRegistry" in endpoints.body:
                cluster = endpoints.get("fromRegistry", str, "")
                if not dns1123_label(cluster):
                    raise endpoints.fail(f"invalid network {name}: invalid registry name: {cluster}")
                if cluster == DEFAULT_CLUSTER_ID:  # another cluster's registry: none of our endpoints
                    registry.append(str(name))
        for gateway in items(network, "gateways"):
            only(gateway, ("address", "port"), ("registryServiceName", "locality"))
            address = gateway.get("address", str, "")
            try:
                ipaddress.ip_address(address)
            except ValueError:
                # A hostname, resolved by istiod (istiod/gatewaynames.py) unless RESOLVE_HOSTNAME_GATEWAYS
                # is off: then istiod's message.
                if not resolve_hostname_gateways() or fqdn_error(address):
                    raise gateway.fail(f"invalid network {name}: {address!r} is not a valid IP "
                                       "(hostname is allowed if RESOLVE_HOSTNAME_GATEWAYS is enabled)") from None
            number = port(gateway, "port")
            if number is None:
                raise gateway.fail(f"invalid network {name}: port number 0 must be in the range 1..65535")
            gateways.append(NetworkGateway(str(name), address, number))
    if len(registry) > 1:  # istiod's warning; it keeps one (we, the first by name)
        log.warning("%s: multiple networks specify %s in fromRegistry; endpoints from %s will continue to be treated "
                    "as part of %s", mesh_networks.key, DEFAULT_CLUSTER_ID, DEFAULT_CLUSTER_ID, registry[0])
    return MeshNetworks(tuple(sorted(gateways)), registry[0] if registry else "", tuple(cidrs))


def _default_export_to(f: _Fields, field: str, base: tuple[str, ...]) -> tuple[str, ...]:
    """Namespaces, `.`, `*` or `~`, unchecked as istiod takes them (a value that names no
    namespace exports to none)."""
    return tuple(sorted(set(str_list(f, field)))) if field in f.body else base


def _access_log(f: _Fields, base: MeshConfig) -> AccessLogSettings | None:
    """accessLogFile ("": off), accessLogEncoding, accessLogFormat. A JSON format that does not parse
    as a JSON object is logged and Istio's default used instead, as istiod does."""
    if not any(k in f.body for k in ("accessLogFile", "accessLogEncoding", "accessLogFormat")):
        return base.access_log
    path = f.get("accessLogFile", str, base.access_log.path if base.access_log else "")
    encoding = f.get("accessLogEncoding", str, "TEXT")
    if encoding not in ("TEXT", "JSON"):
        raise f.fail(f"accessLogEncoding: {encoding!r} is not TEXT or JSON")
    text = f.get("accessLogFormat", str, "")
    if encoding == "JSON" and text:
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            log.error("%s: accessLogFormat is not a JSON object; the default JSON format is used", f.key)
            text = ""
    return AccessLogSettings(path, encoding, text) if path else None


def _protocol_detection_timeout(f: _Fields, base: MeshConfig) -> float:
    if "protocolDetectionTimeout" not in f.body:
        return base.protocol_detection_timeout
    try:
        return parse_duration(f.get("protocolDetectionTimeout", str, ""))
    except argparse.ArgumentTypeError as error:
        raise f.fail(f"protocolDetectionTimeout: {error}") from None


def _locality_lb_setting(f: _Fields, base: MeshConfig) -> LocalityLbSetting | None:
    if "localityLbSetting" not in f.body:
        return base.locality_lb_setting
    setting = locality_lb_setting(f, "localityLbSetting")
    return None if setting is None or setting.enabled is False else setting


_EXT_AUTHZ = {"envoyExtAuthzHttp": False, "envoyExtAuthzGrpc": True}
_EXT_AUTHZ_COMMON = ("service", "port", "timeout", "failOpen", "statusOnError", "includeRequestBodyInCheck",
                     "clearRouteCache")
_EXT_AUTHZ_HTTP = ("pathPrefix", "includeRequestHeadersInCheck", "includeHeadersInCheck",
                   "includeAdditionalHeadersInCheck", "headersToUpstreamOnAllow", "headersToDownstreamOnDeny",
                   "headersToDownstreamOnAllow")


def _extension_providers(f: _Fields) -> tuple[tuple[ExtAuthzProvider, ...], list[str]]:
    """The external authorizers, validated as istiod validates them; other kinds (tracing,
    access logging) are named as ignored."""
    providers: list[ExtAuthzProvider] = []
    ignored: list[str] = []
    names: set[str] = set()
    for i, p in enumerate(items(f, "extensionProviders")):
        where = f"extensionProviders[{i}]"
        name = p.get("name", str, "")
        if not name:
            raise f.fail(f"{where}.name: extension provider name must not be empty")
        if name in names:
            raise f.fail(f"{where}.name: extension provider name must be unique, found duplicate: {name}")
        names.add(name)
        kinds = [k for k in p.body if k != "name"]
        if len(kinds) != 1:
            raise f.fail(f"{where}: exactly one provider kind must be set, found {kinds or 'none'}")
        kind = kinds[0]
        if kind not in _EXT_AUTHZ:
            ignored.append(f"{where}.{kind} ({name})")
            continue
        c = fields(p, kind)
        if c is None:
            raise f.fail(f"{where}.{kind}: expected a map")
        grpc = _EXT_AUTHZ[kind]
        only(c, _EXT_AUTHZ_COMMON + (() if grpc else _EXT_AUTHZ_HTTP))
        providers.append(_ext_authz(c, f"{where}.{kind}", name, grpc))
    return tuple(providers), ignored


def _ext_authz(c: _Fields, where: str, name: str, grpc: bool) -> ExtAuthzProvider:
    service = c.get("service", str, "")
    host = service.rpartition("/")[2]
    if not service or not host or service.count("/") > 1:
        raise c.fail(f"service: {service!r} must be `host` or `namespace/host`")
    port = c.get("port", int, 0)
    if not 0 < port < 65536:
        raise c.fail(f"port: port number {port} must be in the range 1..65535")
    timeout = None
    if "timeout" in c.body:
        try:
            timeout = parse_duration(c.get("timeout", str, ""))
        except argparse.ArgumentTypeError as error:
            raise c.fail(f"timeout: {error}") from None
    status = c.get("statusOnError", str, "")
    if status and not (status.isdigit() and 100 <= int(status) <= 599):
        raise c.fail(f"statusOnError: invalid statusOnError value {status}")
    prefix = c.get("pathPrefix", str, "")
    if prefix and not prefix.startswith("/"):
        raise c.fail(f"pathPrefix: pathPrefix should begin with `/` but found {prefix!r}")
    headers = {}
    for field in ("includeRequestHeadersInCheck", "includeHeadersInCheck", "headersToUpstreamOnAllow",
                  "headersToDownstreamOnDeny", "headersToDownstreamOnAllow"):
        headers[field] = str_list(c, field)
        if "*" in headers[field]:
            raise c.fail(f"{field}: a single wildcard (\"*\") is not supported, change it to either prefix or "
                         "suffix match")
    return ExtAuthzProvider(
        name, grpc, service, port, timeout, c.get("failOpen", bool, False), int(status) if status else None, prefix,
        headers["includeRequestHeadersInCheck"] or headers["includeHeadersInCheck"],
        c.str_map("includeAdditionalHeadersInCheck"), headers["headersToUpstreamOnAllow"],
        headers["headersToDownstreamOnDeny"], headers["headersToDownstreamOnAllow"], _request_body(c),
        c.get("clearRouteCache", bool, False))


def _request_body(c: _Fields) -> RequestBody | None:
    body = fields(c, "includeRequestBodyInCheck")
    if body is None:
        return None
    only(body, ("maxRequestBytes", "allowPartialMessage", "packAsBytes"))
    size = body.get("maxRequestBytes", int, 0)
    if not 0 <= size < 1 << 32:
        raise body.fail(f"maxRequestBytes: {size} is not a uint32")
    return RequestBody(size, body.get("allowPartialMessage", bool, False), body.get("packAsBytes", bool, False))


def read_mesh_file(path: Path, base: MeshConfig) -> MeshConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise MeshConfigError(f"mesh config {path}: {error.strerror or error}") from None
    return parse_mesh_config(text, base, f"mesh config {path}")


def read_mesh_networks_file(path: Path) -> MeshNetworks:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise MeshConfigError(f"mesh networks {path}: {error.strerror or error}") from None
    return parse_mesh_networks(text, f"mesh networks {path}")


MeshListener = Callable[[MeshConfig], None]


class MeshFileWatcher(Generic[T]):
    """Polls the file (the mesh config's, or the mesh networks'); a bad edit is logged and the last
    good value stays."""

    def __init__(self, path: Path, read: Callable[[Path], T], on_change: Callable[[T], None],
                 poll_interval: float = 1.0) -> None:
        self.path, self.read, self.on_change, self.poll_interval = path, read, on_change, poll_interval
        self._signature = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            signature = await asyncio.to_thread(self._stat)
            if signature == self._signature:
                continue
            self._signature = signature
            try:
                value = await asyncio.to_thread(self.read, self.path)
            except MeshConfigError as error:
                log.error("%s; keeping the last good mesh config", error)
                continue
            self.on_change(value)


class MeshConfigMapWatcher:
    """Watches the ConfigMap `istio` (a revision's: `istio-<rev>`) in istiod's namespace (as an
    informer's writer): its key `mesh` over the flags' values, and its key `meshNetworks`; deleting
    it goes back to those values."""

    def __init__(self, api: client.ApiClient, namespace: str, base: MeshConfig, on_change: MeshListener,
                 watch_timeout: int = 300, name: str = CONFIGMAP) -> None:
        self.namespace, self.base, self.on_change, self.name = namespace, base, on_change, name
        self.mesh = base
        core = client.CoreV1Api(api)
        call = functools.partial(core.list_namespaced_config_map, namespace, field_selector=f"metadata.name={name}")
        self.informer = Informer("ConfigMap", call, self, watch_timeout)

    def apply(self, body: dict[str, Any]) -> object:
        where = f"ConfigMap {self.namespace}/{self.name} key"
        data = body.get("data") or {}
        try:
            mesh = parse_mesh_config(data.get(CONFIGMAP_KEY, ""), self.base, f"{where} {CONFIGMAP_KEY}")
            if MESH_NETWORKS_KEY in data:  # as istiod, it replaces the networks the mesh key names
                mesh = parse_mesh_networks(data[MESH_NETWORKS_KEY], f"{where} {MESH_NETWORKS_KEY}").apply(mesh)
        except MeshConfigError as error:
            log.error("%s; keeping the last good mesh config", error)
            return None
        self._set(mesh)
        return None

    def delete(self, body: dict[str, Any]) -> None:
        self._set(self.base)

    def replace(self, kind: str, items: list[dict[str, Any]]) -> None:
        if items:
            self.apply(items[0])
        else:
            self._set(self.base)

    def _set(self, mesh: MeshConfig) -> None:
        if mesh != self.mesh:
            self.mesh = mesh
            self.on_change(mesh)

"""EnvoyFilter, read and validated as istiod's validation does (pkg/config/validation/envoyfilter),
with Istio's messages. The patch values are parsed into Envoy's messages here, so an object whose
value names an unknown type or field is refused before any proxy could be sent it."""

from __future__ import annotations

from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.protobuf import json_format
from google.protobuf.message import Message

from istiod import prototypes
from istiod.model.config import envoyfilter as ef
from istiod.model.config.common import regex_problem
from istiod.sources.fields import ObjectKey, _Fields
from istiod.sources.istio.common import fields, items, meta, only, spec
from istiod.sources.istio.networking import _labels_selector

MESSAGES: dict[str, type[Message]] = {
    ef.LISTENER: listener_pb2.Listener, ef.FILTER_CHAIN: listener_components_pb2.FilterChain,
    ef.NETWORK_FILTER: listener_components_pb2.Filter, ef.HTTP_FILTER: hcm_pb2.HttpFilter,
    ef.ROUTE_CONFIGURATION: route_pb2.RouteConfiguration, ef.VIRTUAL_HOST: route_components_pb2.VirtualHost,
    ef.HTTP_ROUTE: route_components_pb2.Route, ef.CLUSTER: cluster_pb2.Cluster,
}
_NOT_IMPLEMENTED_APPLY_TO = ("LISTENER_FILTER", "EXTENSION_CONFIG", "BOOTSTRAP")
_MAX_PROXY_VERSION = 1024


def envoy_filter(key: ObjectKey, f: _Fields, domain: str) -> ef.EnvoyFilter:
    body = spec(f, ("workloadSelector", "configPatches", "priority"), unsupported=("targetRefs",))
    selector = _labels_selector(f)
    patches = []
    for i, item in enumerate(items(f, "spec.configPatches")):
        patch = _config_patch(item, f"spec.configPatches[{i}]")
        if patch is not None:
            patches.append(patch)
    return ef.EnvoyFilter(meta(key), tuple(patches), selector, body.get("priority", int, 0),
                          f.get("metadata.creationTimestamp", str, ""))


def _config_patch(f: _Fields, path: str) -> ef.ConfigPatch | None:
    only(f, ("applyTo", "match", "patch"))
    match = fields(f, "match")
    if match is not None:
        only(match, ("context", "proxy", "listener", "routeConfiguration", "cluster"))
    context = match.get("context", str, "ANY") if match is not None else "ANY"
    if context == "WAYPOINT":
        raise f.fail("match.context: WAYPOINT patches are not implemented by this istiod (its waypoints are not patched)")
    if context not in ef.CONTEXTS:
        raise f.fail(f"match.context: {context!r} is not one of {', '.join(ef.CONTEXTS)}")
    apply_to = f.get("applyTo", str, "INVALID")
    if apply_to == "INVALID":
        raise f.fail("Envoy filter: missing applyTo")
    if apply_to in _NOT_IMPLEMENTED_APPLY_TO:
        raise f.fail(f"applyTo: {apply_to} is not implemented by this istiod")
    if apply_to not in ef.APPLY_TO:
        raise f.fail(f"applyTo: {apply_to!r} is not one of {', '.join(ef.APPLY_TO)}")
    patch = fields(f, "patch")
    if patch is None:
        raise f.fail("Envoy filter: missing patch")
    only(patch, ("operation", "value", "filterClass"))
    if patch.get("filterClass", str, "UNSPECIFIED") != "UNSPECIFIED":
        raise patch.fail("filterClass is not implemented by this istiod (place the filter with INSERT_BEFORE/AFTER)")
    operation = patch.get("operation", str, "INVALID")
    if operation == "INVALID":
        raise f.fail("Envoy filter: missing patch operation")
    if operation not in ef.OPERATIONS:
        raise patch.fail(f"operation: {operation!r} is not one of {', '.join(ef.OPERATIONS)}")
    value = patch.get("value", dict, None)
    if operation != "REMOVE" and value is None:
        raise f.fail("Envoy filter: missing patch value for non-remove operation")
    if operation in ("INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST") and \
            apply_to not in (ef.HTTP_FILTER, ef.NETWORK_FILTER, ef.HTTP_ROUTE):
        operation = "ADD"  # istiod's: inserting has a place only among filters and routes
    version = ""
    if match is not None and (proxy := fields(match, "proxy")) is not None:
        only(proxy, ("proxyVersion",), unsupported=("metadata",))
        version = proxy.get("proxyVersion", str, "")
        if len(version) > _MAX_PROXY_VERSION:
            raise f.fail(f"Envoy filter: proxyVersion match exceeds {_MAX_PROXY_VERSION} characters")
        if version and (problem := regex_problem(version)) is not None:
            raise f.fail(f"Envoy filter: invalid regex for proxy version, [{problem}]")
    listener = route = cluster = None
    if match is not None:
        listener, route, cluster = _listener(match), _route(match), _cluster(match)
    if apply_to in (ef.LISTENER, ef.FILTER_CHAIN, ef.NETWORK_FILTER, ef.HTTP_FILTER) and (route or cluster):
        raise f.fail("Envoy filter: applyTo for listener class objects cannot have non listener match")
    if apply_to in (ef.ROUTE_CONFIGURATION, ef.VIRTUAL_HOST, ef.HTTP_ROUTE) and (listener or cluster):
        raise f.fail("Envoy filter: applyTo for http route class objects cannot have non route configuration match")
    if apply_to == ef.CLUSTER and (listener or route):
        raise f.fail("Envoy filter: applyTo for cluster class objects cannot have non cluster match")
    if listener is not None and listener.sub_filter_name and apply_to != ef.HTTP_FILTER:
        raise f.fail("Envoy filter: subfilter match can be used with applyTo HTTP_FILTER only")
    return ef.ConfigPatch(apply_to, operation, _value(patch, apply_to, value) if value is not None else b"",
                          context, version, listener, route, cluster)


def _value(patch: _Fields, apply_to: str, value: dict[str, Any]) -> bytes:
    """The value as the message applyTo names; unknown fields dropped, as istiod builds it."""
    unknown = [name for name in prototypes.named_types(value) if not prototypes.load(name)]
    if unknown:
        raise patch.fail(f"value: referenced type unknown: {', '.join(unknown)}")
    try:
        message = json_format.ParseDict(value, MESSAGES[apply_to](), ignore_unknown_fields=True)
    except Exception as error:  # ParseError mostly; protobuf's parser lets others out on odd values (`@type: null`)
        raise patch.fail(f"value: not a {MESSAGES[apply_to].DESCRIPTOR.full_name}: {error}") from None
    return message.SerializeToString(deterministic=True)


def _listener(match: _Fields) -> ef.ListenerMatch | None:
    listener = fields(match, "listener")
    if listener is None:
        return None
    only(listener, ("portNumber", "portName", "filterChain", "listenerFilter", "name"))
    if listener.get("listenerFilter", str, ""):
        raise listener.fail("listenerFilter: matching listener filters is not implemented by this istiod")
    if listener.get("portName", str, ""):
        raise listener.fail("portName: deprecated in Istio's API and not implemented by this istiod")
    chain = fields(listener, "filterChain")
    port, name = listener.get("portNumber", int, 0), listener.get("name", str, "")
    if chain is None:
        return ef.ListenerMatch(port, name)
    only(chain, ("name", "sni", "transportProtocol", "applicationProtocols", "filter", "destinationPort"))
    filter_name = sub_name = ""
    if (network := fields(chain, "filter")) is not None:
        only(network, ("name", "subFilter"))
        filter_name = network.get("name", str, "")
        if not filter_name:
            raise network.fail("Envoy filter: filter match has no name to match on")
        if (sub := fields(network, "subFilter")) is not None:
            only(sub, ("name",))
            if filter_name not in ef.HCM_NAMES:
                raise network.fail(f"Envoy filter: subfilter match requires filter match with {ef.HCM_NAMES[0]}")
            sub_name = sub.get("name", str, "")
            if not sub_name:
                raise sub.fail("Envoy filter: subfilter match has no name to match on")
    return ef.ListenerMatch(port, name, chain=True, chain_name=chain.get("name", str, ""), sni=chain.get("sni", str, ""),
                            transport_protocol=chain.get("transportProtocol", str, ""),
                            application_protocols=chain.get("applicationProtocols", str, ""),
                            destination_port=chain.get("destinationPort", int, 0),
                            filter_name=ef.HCM_NAMES[0] if filter_name == ef.HCM_NAMES[1] else filter_name,
                            sub_filter_name=sub_name)


def _route(match: _Fields) -> ef.RouteMatch | None:
    route = fields(match, "routeConfiguration")
    if route is None:
        return None
    only(route, ("portNumber", "portName", "gateway", "vhost", "name"))
    common = (route.get("portNumber", int, 0), route.get("portName", str, ""), route.get("gateway", str, ""),
              route.get("name", str, ""))
    vhost = fields(route, "vhost")
    if vhost is None:
        return ef.RouteMatch(*common)
    only(vhost, ("name", "domainName", "route"))
    inner = fields(vhost, "route")
    if inner is not None:
        only(inner, ("name", "action"))
    action = inner.get("action", str, "ANY") if inner is not None else "ANY"
    if action not in ef.ROUTE_ACTIONS:
        raise route.fail(f"vhost.route.action: {action!r} is not one of {', '.join(ef.ROUTE_ACTIONS)}")
    return ef.RouteMatch(*common, vhost=True, vhost_name=vhost.get("name", str, ""),
                         domain_name=vhost.get("domainName", str, ""), route=inner is not None,
                         route_name=inner.get("name", str, "") if inner is not None else "", action=action)


def _cluster(match: _Fields) -> ef.ClusterMatch | None:
    cluster = fields(match, "cluster")
    if cluster is None:
        return None
    only(cluster, ("portNumber", "service", "subset", "name"))
    return ef.ClusterMatch(cluster.get("portNumber", int, 0), cluster.get("service", str, ""),
                           cluster.get("subset", str, ""), cluster.get("name", str, ""))

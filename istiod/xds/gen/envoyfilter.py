"""EnvoyFilter patches on what the sidecar and gateway generators make, as istiod's envoyfilter
package applies them: listeners (and their filter chains, network filters and HTTP filters), route
configurations (virtual hosts, routes) and clusters; merged, added, inserted, replaced, removed.

The EnvoyFilters of the mesh's root namespace and of the proxy's own, those whose workloadSelector
matches it, in istiod's order (priority, then creation time, name, namespace). A proxy no patch
applies to gets the generator's resources untouched; a patched resource is made once per snapshot
for every proxy with the same patches. Pure apart from the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TypeVar

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.protobuf import any_pb2, duration_pb2, symbol_database
from google.protobuf.message import Message

from istiod import prototypes
from istiod.model.config import envoyfilter as ef
from istiod.model.config.common import compile_regex
from istiod.model.names import parse_cluster_name
from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds import types
from istiod.xds.cache import Resource, ResourceCache
from istiod.xds.gen.generator import Generator

_Patches = dict[str, list[ef.ConfigPatch]]
_M = TypeVar("_M", bound=Message)

GATEWAY, INBOUND, OUTBOUND = "GATEWAY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND"
_APPLIED_TO = {
    types.LISTENER: (ef.LISTENER, ef.FILTER_CHAIN, ef.NETWORK_FILTER, ef.HTTP_FILTER),
    types.ROUTE: (ef.ROUTE_CONFIGURATION, ef.VIRTUAL_HOST, ef.HTTP_ROUTE),
    types.CLUSTER: (ef.CLUSTER,),
}
_MERGES = ("MERGE", "MERGE_AND_REPLACE_LIST")
_MESSAGE_TYPES: dict[str, type[Message]] = {types.LISTENER: listener_pb2.Listener, types.ROUTE: route_pb2.RouteConfiguration,
                                            types.CLUSTER: cluster_pb2.Cluster}


def patched(type_url: str, generate: Generator) -> Generator:
    """`generate` with the EnvoyFilters that apply to the proxy applied to what it makes."""
    def generate_patched(snapshot: Snapshot, proxy: Proxy, names: list[str] | None,
                         cache: ResourceCache) -> list[Resource]:
        resources = generate(snapshot, proxy, names, cache)
        patches = tuple(patches_for(snapshot, proxy, _APPLIED_TO[type_url]))
        if not patches:
            return resources
        how = ("envoyfilter", proxy.type, patches)
        out = []
        for resource in resources:
            if (made := cache.derived(resource, how, partial(patch, type_url, proxy.type, resource, patches))) is not None:
                out.append(made)
        added = cache.per_snapshot(snapshot, (*how, type_url), lambda: additions(type_url, proxy.type, patches))
        return out + [r for r in added if names is None or r.name in names]
    return generate_patched


def patches_for(snapshot: Snapshot, proxy: Proxy, apply_to: Iterable[str]) -> list[ef.ConfigPatch]:
    """The patches of these kinds that apply to the proxy, in the order istiod applies them."""
    wanted = set(apply_to)
    filters = snapshot.config.envoy_filters_for(proxy.namespace, dict(proxy.labels), snapshot.mesh.root_namespace)
    return [p for f in filters for p in f.patches if p.apply_to in wanted and _proxy_matches(p, proxy)]


def _proxy_matches(patch: ef.ConfigPatch, proxy: Proxy) -> bool:
    if not patch.proxy_version:
        return True
    return bool(proxy.istio_version) and compile_regex(patch.proxy_version).search(proxy.istio_version) is not None


def patch(type_url: str, node_type: str, resource: Resource, patches: Sequence[ef.ConfigPatch]) -> Message | None:
    """Pure: the resource with the patches applied; None when one removes it."""
    message = _MESSAGE_TYPES[type_url].FromString(resource.value)
    grouped = _grouped(type_url, patches)
    return message if _patch(type_url, _context(type_url, node_type, message), grouped, message) else None


def additions(type_url: str, node_type: str, patches: Sequence[ef.ConfigPatch]) -> list[Resource]:
    """Pure: the listeners or clusters the patches add (route configurations are asked for by name)."""
    if type_url == types.ROUTE:
        return []
    grouped, out = _grouped(type_url, patches), []
    kind = ef.LISTENER if type_url == types.LISTENER else ef.CLUSTER
    for context in (GATEWAY,) if node_type == "router" else (INBOUND, OUTBOUND):
        for added in grouped[kind]:
            if added.operation == "ADD" and _adds_in(added, context):
                value = _value(added, _MESSAGE_TYPES[type_url])
                out.append(Resource(getattr(value, "name"), type_url, value.SerializeToString(deterministic=True)))
    return out


def _grouped(type_url: str, patches: Sequence[ef.ConfigPatch]) -> _Patches:
    return {kind: [p for p in patches if p.apply_to == kind] for kind in _APPLIED_TO[type_url]}


def _adds_in(patch: ef.ConfigPatch, context: str) -> bool:
    """istiod adds a listener or cluster with context ANY only among outbound ones and gateways'."""
    if patch.context == "ANY":
        return context in (OUTBOUND, GATEWAY)
    return patch.context == context


def _context(type_url: str, node_type: str, message: Message) -> str:
    if node_type == "router":
        return GATEWAY
    if type_url == types.LISTENER:
        return INBOUND if getattr(message, "traffic_direction") == base_pb2.INBOUND else OUTBOUND
    return INBOUND if getattr(message, "name").startswith("inbound|") else OUTBOUND


def _patch(type_url: str, context: str, patches: _Patches, message: Message) -> bool:
    """Patches `message` in place; False when a patch removes it."""
    if type_url == types.LISTENER:
        assert isinstance(message, listener_pb2.Listener)
        return _patch_listener(context, patches, message)
    if type_url == types.ROUTE:
        assert isinstance(message, route_pb2.RouteConfiguration)
        _patch_route_configuration(context, patches, message)
        return True
    for patch in patches[ef.CLUSTER]:
        if not _in_context(patch, context) or not _cluster_matches(patch, getattr(message, "name")):
            continue
        if patch.operation == "REMOVE":
            return False
        if patch.operation in _MERGES and not _merge_transport_socket(message, patch, clusters=True):
            merge(message, _value(patch, type(message)), patch.operation)
    return True


def _in_context(patch: ef.ConfigPatch, context: str) -> bool:
    return patch.context in ("ANY", context)


def _value(patch: ef.ConfigPatch, message_type: type[_M]) -> _M:
    """A fresh copy of the patch's value: what it is merged into or inserted in is changed later."""
    return message_type.FromString(patch.value)


# --- listeners --------------------------------------------------------------------------------

def _patch_listener(context: str, patches: _Patches, listener: listener_pb2.Listener) -> bool:
    for patch in patches[ef.LISTENER]:
        if not _in_context(patch, context) or not _listener_matches(listener, patch):
            continue
        if patch.operation == "REMOVE":
            return False
        if patch.operation in _MERGES:
            merge(listener, _value(patch, listener_pb2.Listener), patch.operation)
    kept = [c for c in listener.filter_chains if not c.filters or _patch_chain(context, patches, listener, c)]
    if listener.HasField("default_filter_chain") and listener.default_filter_chain.filters:
        if not _patch_chain(context, patches, listener, listener.default_filter_chain):
            listener.ClearField("default_filter_chain")
    for patch in patches[ef.FILTER_CHAIN]:
        if patch.operation == "ADD" and _in_context(patch, context) and _listener_matches(listener, patch):
            kept.append(_value(patch, listener_components_pb2.FilterChain))
    chains = [_copy(c) for c in kept]  # copied before the field they are in is emptied
    del listener.filter_chains[:]
    listener.filter_chains.extend(chains)
    return True


def _copy(message: _M) -> _M:
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


def _patch_chain(context: str, patches: _Patches, listener: listener_pb2.Listener,
                 chain: listener_components_pb2.FilterChain) -> bool:
    for patch in patches[ef.FILTER_CHAIN]:
        if not (_in_context(patch, context) and _listener_matches(listener, patch)
                and _chain_matches(listener, chain, patch)):
            continue
        if patch.operation == "REMOVE":
            return False
        if patch.operation in _MERGES and not _merge_transport_socket(chain, patch, clusters=False):
            merge(chain, _value(patch, listener_components_pb2.FilterChain), patch.operation)
    filters = list(chain.filters)
    for patch in patches[ef.NETWORK_FILTER]:
        if _in_context(patch, context) and _listener_matches(listener, patch) and _chain_matches(listener, chain, patch):
            filters = _placed(filters, patch, lambda f: _filter_matches(f, patch),
                              lambda: _value(patch, listener_components_pb2.Filter), bool(_filter_name(patch)))
    for network in filters:
        _patch_network_filter(context, patches, listener, chain, network)
    del chain.filters[:]
    chain.filters.extend(filters)
    return True


def _placed(items: list[_M], patch: ef.ConfigPatch, matches: Callable[[_M], bool], value: Callable[[], _M],
            has_match: bool) -> list[_M]:
    """ADD, INSERT_FIRST/BEFORE/AFTER, REPLACE and REMOVE of one filter or route among `items`, as
    istiod: without a match to place it by, INSERT_BEFORE goes first and INSERT_AFTER last; REPLACE
    and REMOVE need one. MERGE is applied to each item afterwards."""
    operation = patch.operation
    if operation == "ADD" or operation == "INSERT_AFTER" and not has_match:
        return [*items, value()]
    if operation == "INSERT_FIRST" or operation == "INSERT_BEFORE" and not has_match:
        return [value(), *items]
    if not has_match or operation not in ("INSERT_BEFORE", "INSERT_AFTER", "REPLACE", "REMOVE"):
        return items
    if operation == "REMOVE":
        return [item for item in items if not matches(item)]
    index = next((i for i, item in enumerate(items) if matches(item)), None)
    if index is None:
        return items
    if operation == "REPLACE":
        return [*items[:index], value(), *items[index + 1:]]
    at = index if operation == "INSERT_BEFORE" else index + 1
    return [*items[:at], value(), *items[at:]]


def _patch_network_filter(context: str, patches: _Patches, listener: listener_pb2.Listener,
                          chain: listener_components_pb2.FilterChain, network: listener_components_pb2.Filter) -> None:
    for patch in patches[ef.NETWORK_FILTER]:
        if (patch.operation == "MERGE" and network.HasField("typed_config") and _in_context(patch, context)
                and _listener_matches(listener, patch) and _chain_matches(listener, chain, patch)
                and _filter_matches(network, patch)):
            _merge_filter(network, _value(patch, listener_components_pb2.Filter))
    if network.name in ef.HCM_NAMES and patches[ef.HTTP_FILTER]:
        _patch_http_filters(context, patches, listener, chain, network)


def _merge_filter(target: listener_components_pb2.Filter | hcm_pb2.HttpFilter,
                  patch: listener_components_pb2.Filter | hcm_pb2.HttpFilter) -> None:
    """istiod's filter MERGE: the name, if the patch has one, and the typed configs merged as
    messages (a config of another type replaces it)."""
    if patch.name:
        target.name = patch.name
    if patch.HasField("typed_config"):
        target.typed_config.CopyFrom(_merged_any(target.typed_config, patch.typed_config))


def _merged_any(target: any_pb2.Any, patch: any_pb2.Any) -> any_pb2.Any:
    if target.type_url != patch.type_url:
        return patch
    name = target.type_url.rsplit("/", 1)[-1]
    if not prototypes.load(name):
        return patch
    message_type = symbol_database.Default().GetSymbol(name)
    inner, change = message_type(), message_type()
    target.Unpack(inner)
    patch.Unpack(change)
    merge(inner, change, "MERGE")
    result = any_pb2.Any()
    result.Pack(inner)
    return result


def _patch_http_filters(context: str, patches: _Patches, listener: listener_pb2.Listener,
                        chain: listener_components_pb2.FilterChain, network: listener_components_pb2.Filter) -> None:
    hcm = hcm_pb2.HttpConnectionManager()
    if not network.typed_config.Unpack(hcm):
        return
    applying = [p for p in patches[ef.HTTP_FILTER] if _in_context(p, context) and _listener_matches(listener, p)
                and _chain_matches(listener, chain, p) and _filter_matches(network, p)]
    if not applying:
        return
    filters = list(hcm.http_filters)
    for patch in applying:
        filters = _placed(filters, patch, lambda f: _http_filter_matches(f, patch),
                          lambda: _value(patch, hcm_pb2.HttpFilter), bool(_sub_filter_name(patch)))
    for http_filter in filters:
        for patch in applying:
            if patch.operation == "MERGE" and http_filter.HasField("typed_config") and _http_filter_matches(http_filter, patch):
                _merge_filter(http_filter, _value(patch, hcm_pb2.HttpFilter))
    del hcm.http_filters[:]
    hcm.http_filters.extend(filters)
    network.typed_config.Pack(hcm)


def _listener_matches(listener: listener_pb2.Listener, patch: ef.ConfigPatch) -> bool:
    match = patch.listener
    if match is None:
        return True
    if match.name and match.name != listener.name:
        return False
    # virtualInbound and virtualOutbound take the port from a filter chain's destination port.
    if patch.apply_to != ef.LISTENER and listener.name in ("virtualInbound", "virtualOutbound"):
        return True
    return not match.port_number or listener.address.socket_address.port_value == match.port_number


def _chain_matches(listener: listener_pb2.Listener, chain: listener_components_pb2.FilterChain,
                   patch: ef.ConfigPatch) -> bool:
    match = patch.listener
    if match is None:
        return True
    found = chain.filter_chain_match
    virtual = listener.name in ("virtualInbound", "virtualOutbound")
    if virtual and match.port_number and found.destination_port.value != match.port_number:
        return False
    if not match.chain:
        return True
    if match.chain_name and match.chain_name != chain.name:
        return False
    if match.sni and match.sni not in found.server_names:
        return False
    if match.transport_protocol and found.transport_protocol != match.transport_protocol:
        return False
    if match.application_protocols and not all(
            p in found.application_protocols for p in match.application_protocols.split(",")):
        return False
    return not match.destination_port or (found.HasField("destination_port")
                                          and found.destination_port.value == match.destination_port)


def _filter_name(patch: ef.ConfigPatch) -> str:
    return patch.listener.filter_name if patch.listener is not None else ""


def _sub_filter_name(patch: ef.ConfigPatch) -> str:
    return patch.listener.sub_filter_name if patch.listener is not None else ""


def _filter_matches(network: listener_components_pb2.Filter, patch: ef.ConfigPatch) -> bool:
    name = _filter_name(patch)
    return not name or network.name == name


def _http_filter_matches(http_filter: hcm_pb2.HttpFilter, patch: ef.ConfigPatch) -> bool:
    name = _sub_filter_name(patch)
    return not name or http_filter.name == name


def _merge_transport_socket(message: Message, patch: ef.ConfigPatch, clusters: bool) -> bool:
    """istiod's transport socket merge: a patch carrying one merges it into the socket of that name
    (its typed configs merged); a cluster's other socket, or one it lacks, is replaced (a cluster
    with transport socket matches keeps them). True when that was the whole merge."""
    value = _value(patch, type(message))
    socket = getattr(value, "transport_socket")
    if not value.HasField("transport_socket"):
        return False
    own = getattr(message, "transport_socket")
    if clusters:
        matched = [m.transport_socket for m in getattr(message, "transport_socket_matches")
                   if m.transport_socket.name == socket.name]
        if getattr(message, "transport_socket_matches"):
            target = matched[0] if matched else None
            if target is not None and target.HasField("typed_config") and socket.HasField("typed_config"):
                target.typed_config.CopyFrom(_merged_any(target.typed_config, socket.typed_config))
            return True
        if not message.HasField("transport_socket") or own.name != socket.name:
            own.CopyFrom(socket)
            return True
    elif not message.HasField("transport_socket") or own.name != socket.name:
        return False
    if own.HasField("typed_config") and socket.HasField("typed_config"):
        own.typed_config.CopyFrom(_merged_any(own.typed_config, socket.typed_config))
    return True


# --- route configurations ---------------------------------------------------------------------

def _patch_route_configuration(context: str, patches: _Patches, config: route_pb2.RouteConfiguration) -> None:
    for patch in patches[ef.ROUTE_CONFIGURATION]:
        if patch.operation in _MERGES and _in_context(patch, context) and _route_config_matches(context, config, patch):
            merge(config, _value(patch, route_pb2.RouteConfiguration), patch.operation)
    hosts = []
    for host in config.virtual_hosts:
        kept = _patch_virtual_host(context, patches, config, host)
        if kept is not None:
            hosts.append(kept)
    for patch in patches[ef.VIRTUAL_HOST]:
        if patch.operation == "ADD" and _in_context(patch, context) and _route_config_matches(context, config, patch):
            hosts.append(_value(patch, route_components_pb2.VirtualHost))
    hosts = [_copy(h) for h in hosts]
    del config.virtual_hosts[:]
    config.virtual_hosts.extend(hosts)


def _patch_virtual_host(context: str, patches: _Patches, config: route_pb2.RouteConfiguration,
                        host: route_components_pb2.VirtualHost) -> route_components_pb2.VirtualHost | None:
    for patch in patches[ef.VIRTUAL_HOST]:
        if not (_in_context(patch, context) and _route_config_matches(context, config, patch)
                and _virtual_host_matches(host, patch)):
            continue
        if patch.operation == "REMOVE":
            return None
        if patch.operation in _MERGES:
            merge(host, _value(patch, route_components_pb2.VirtualHost), patch.operation)
        elif patch.operation == "REPLACE":
            host = _value(patch, route_components_pb2.VirtualHost)
    applying = [p for p in patches[ef.HTTP_ROUTE] if _in_context(p, context)
                and _route_config_matches(context, config, p) and _virtual_host_matches(host, p)]
    if not applying:
        return host
    routes = list(host.routes)
    for route in routes:
        for patch in applying:
            if patch.operation in _MERGES and _route_matches(route, patch):
                merge(route, _value(patch, route_components_pb2.Route), patch.operation)
    routes = [r for r in routes if not any(p.operation == "REMOVE" and _route_matches(r, p) for p in applying)]
    for patch in applying:
        if patch.operation == "INSERT_FIRST" and _has_route_match(patch) and not any(_route_matches(r, patch) for r in routes):
            continue  # istiod inserts first only when a route matches, if the patch names one
        if patch.operation != "REPLACE":
            routes = _placed(routes, patch, lambda r: _route_matches(r, patch),
                             lambda: _value(patch, route_components_pb2.Route), _has_route_match(patch))
    routes = [_copy(r) for r in routes]
    del host.routes[:]
    host.routes.extend(routes)
    return host


def _route_config_matches(context: str, config: route_pb2.RouteConfiguration, patch: ef.ConfigPatch) -> bool:
    match = patch.route_configuration
    if match is None:
        return True
    if match.name and match.name != config.name:
        return False
    if context != GATEWAY:
        return not match.port_number or match.port_number == _sidecar_route_port(config.name)
    port, port_name, gateway = _gateway_route_name(config.name)
    return ((not match.port_name or match.port_name == port_name) and (not match.gateway or match.gateway == gateway)
            and (not match.port_number or match.port_number == port))


def _sidecar_route_port(name: str) -> int:
    if name.startswith("inbound|"):
        try:
            return parse_cluster_name(name)[1]
        except ValueError:
            return 0
    return int(name) if name.isdigit() else 0


def _gateway_route_name(name: str) -> tuple[int, str, str]:
    """istiod's ParseGatewayRDSRouteName: `http.<port>` or `https.<port>.<portName>.<gateway>.<ns>`
    -> (port, port name, `<ns>/<gateway>`)."""
    parts = name.split(".")
    if len(parts) < 2 or not parts[1].isdigit():
        return 0, "", ""
    if parts[0] == "http" or len(parts) < 5:
        return int(parts[1]), "", ""
    return int(parts[1]), parts[2], f"{parts[4]}/{parts[3]}"


def _virtual_host_matches(host: route_components_pb2.VirtualHost, patch: ef.ConfigPatch) -> bool:
    match = patch.route_configuration
    if match is None or not match.vhost:
        return True
    return (not match.vhost_name or match.vhost_name == host.name) and \
        (not match.domain_name or match.domain_name in host.domains)


def _has_route_match(patch: ef.ConfigPatch) -> bool:
    return patch.route_configuration is not None and patch.route_configuration.route


def _route_matches(route: route_components_pb2.Route, patch: ef.ConfigPatch) -> bool:
    match = patch.route_configuration
    if match is None or not match.route:
        return True
    if match.route_name and match.route_name != route.name:
        return False
    action = {"route": "ROUTE", "redirect": "REDIRECT", "direct_response": "DIRECT_RESPONSE"}.get(
        route.WhichOneof("action") or "", "")
    return match.action == "ANY" or match.action == action


# --- clusters ---------------------------------------------------------------------------------

def _cluster_matches(patch: ef.ConfigPatch, name: str) -> bool:
    match = patch.cluster
    if match is None:
        return True
    if match.name:
        return match.name == name
    try:
        _, port, subset, host = parse_cluster_name(name)
    except ValueError:
        port, subset, host = 0, "", ""
    # Inbound clusters name no host; istiod matches them by their service's, which this does not.
    return ((not match.subset or match.subset == subset) and (not match.service or match.service == host)
            and (not match.port_number or match.port_number == port))


# --- merging ----------------------------------------------------------------------------------

def merge(target: Message, patch: Message, operation: str = "MERGE") -> None:
    """istiod's proto merge: protobuf's (scalars set, messages merged, lists appended, map entries
    merged) but a Duration replaced whole; MERGE_AND_REPLACE_LIST replaces the lists the patch sets."""
    replace_lists = operation == "MERGE_AND_REPLACE_LIST"
    for field, value in patch.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            getattr(target, field.name).MergeFrom(value)
        elif field.is_repeated:
            if replace_lists:
                del getattr(target, field.name)[:]
            getattr(target, field.name).extend(value)
        elif field.message_type is None:
            setattr(target, field.name, value)
        elif field.message_type.full_name in (duration_pb2.Duration.DESCRIPTOR.full_name, "google.protobuf.Any"):
            getattr(target, field.name).CopyFrom(value)
        else:
            merge(getattr(target, field.name), value, operation)

"""Where each xDS type sits in an Envoy admin config dump: one table for the server that builds
/debug/config_dump and the `proxy-config` CLI that reads it. Plain strings only (no protobuf
imports), so the CLI stays light."""

from __future__ import annotations

from dataclasses import dataclass

from istiod.xds import types


@dataclass(frozen=True, slots=True)
class DumpLayout:
    kind: str  # the CLI's name for it
    type_url: str  # the xDS type it holds
    dump_type: str  # its message in envoy.admin.v3 (`@type` ends with it)
    entries: str  # the dump's list of dynamic entries
    path: tuple[str, ...]  # fields from one entry down to the resource (an Any)


# In Envoy's order.
DUMP_LAYOUT = (
    DumpLayout("clusters", types.CLUSTER, "ClustersConfigDump", "dynamic_active_clusters", ("cluster",)),
    DumpLayout("listeners", types.LISTENER, "ListenersConfigDump", "dynamic_listeners", ("active_state", "listener")),
    DumpLayout("routes", types.ROUTE, "RoutesConfigDump", "dynamic_route_configs", ("route_config",)),
    DumpLayout("endpoints", types.ENDPOINT, "EndpointsConfigDump", "dynamic_endpoint_configs", ("endpoint_config",)),
)
BY_KIND = {layout.kind: layout for layout in DUMP_LAYOUT}

"""What Istio's own istiod and ours send an Envoy sidecar for the same cluster (a dev tool: it needs
Istio's pilot-discovery, built by shared/reference-istiod/build.sh, which CI does not have).

    python bench/sidecar_compare.py [--reference PATH] [--mesh tests/data/sidecar-shape-mesh.yaml]
                                    [--node sidecar~IP~POD.NS~NS.svc.cluster.local] [--full]

(`--mesh tests/data/sidecar-passthrough-mesh.yaml`: ServiceEntries with resolution NONE and wildcard hosts;
`--mesh tests/data/tunnel-compare-mesh.yaml`: DestinationRule tunnels.)

etcd and kube-apiserver are started (the e2e harness), Istio's CRDs installed and the mesh's objects
created through the API; then Istio's istiod and ours in kube mode on that API server, and a SotW ADS
client as a sidecar's (CDS, LDS, then RDS for the route names the listeners use, ACKing) on each
one's plaintext port. Istio's runs with PILOT_ENABLE_METADATA_EXCHANGE=false and
PILOT_ENABLE_ALPN_FILTER=false: with them it sends filters upstream Envoy NACKs. Prints, per
resource, what a client sees of its shape (listener filter chains: name, match, filters, ALPN;
route virtual hosts and domains; cluster type and ALPN), or with --full every field, for each side,
and exits 1 if anything differs. Every process started here is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2, json_format, message, struct_pb2, symbol_database

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))
from wds_compare import print_fields, side_by_side  # noqa: E402
from adsexchange import until_quiet  # noqa: E402
from reference import add_reference_argument, reference_binary  # noqa: E402

from istiod import prototypes  # noqa: E402

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
MESSAGES: dict[str, Any] = {CLUSTER: cluster_pb2.Cluster, LISTENER: listener_pb2.Listener,
                            ROUTE: route_pb2.RouteConfiguration}
NODE = "sidecar~10.244.0.21~echo-1.demo~demo.svc.cluster.local"
QUIET = 3.0  # seconds without a response: the client holds all there is
HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def _readable(msg: message.Message) -> None:
    """Unpacks every Any in place so that MessageToDict shows it; an unknown one (an Istio-only
    extension) becomes a Struct naming its type."""
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            items = [v for v in value.values() if isinstance(v, message.Message)]
        else:
            items = [value] if isinstance(value, message.Message) else list(value)
        for item in items:
            if field.message_type.full_name == "google.protobuf.Struct":
                continue
            if isinstance(item, any_pb2.Any):
                type_name = item.type_url.rsplit("/", 1)[-1]
                if prototypes.load(type_name):
                    inner = symbol_database.Default().GetSymbol(type_name)()
                    item.Unpack(inner)
                    _readable(inner)
                    item.Pack(inner)
                else:
                    item.Pack(struct_pb2.Struct(fields={"unknownType": struct_pb2.Value(string_value=type_name)}))
            elif isinstance(item, message.Message):
                _readable(item)


def _dict(msg: message.Message) -> dict[str, Any]:
    _readable(msg)
    return json_format.MessageToDict(msg)


async def held(address: str, node: str, labels: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """What a sidecar (or a gateway: a `router~` node with its `labels`) holds from `address` once it is
    quiet: type -> name -> the resource as JSON."""
    _, ip, pod, _ = node.split("~")
    name, namespace = pod.split(".", 1)
    metadata = struct_pb2.Struct()
    metadata.update({"NAME": name, "NAMESPACE": namespace, "INSTANCE_IPS": ip, "CLUSTER_ID": "Kubernetes",
                     "ISTIO_VERSION": "1.31.0", "INTERCEPTION_MODE": "REDIRECT", "SERVICE_ACCOUNT": name.split("-")[0],
                     "GENERATOR": "", "LABELS": labels or {}})
    first = base_pb2.Node(id=node, metadata=metadata)
    result: dict[str, dict[str, Any]] = {CLUSTER: {}, LISTENER: {}, ROUTE: {}}
    route_names: list[str] = []

    def answer(response: discovery_pb2.DiscoveryResponse) -> tuple[list[str], list[discovery_pb2.DiscoveryRequest]]:
        have = result[response.type_url]
        have.clear()
        for resource in response.resources:
            decoded = MESSAGES[response.type_url].FromString(resource.value)
            have[decoded.name] = _dict(decoded)
        names = list(route_names) if response.type_url == ROUTE else []
        if response.type_url == LISTENER:
            wanted = sorted({f["typedConfig"]["rds"]["routeConfigName"] for listener in have.values()
                             for chain in _chains(listener) for f in chain.get("filters", [])
                             if "rds" in f.get("typedConfig", {})})
            if wanted != route_names:
                route_names[:] = wanted
                return names, [discovery_pb2.DiscoveryRequest(type_url=ROUTE, resource_names=wanted)]
        return names, []

    await until_quiet(address, [discovery_pb2.DiscoveryRequest(type_url=t, node=first) for t in (CLUSTER, LISTENER)],
                      answer, QUIET)
    return result


def _chains(listener: dict[str, Any]) -> list[dict[str, Any]]:
    default = listener.get("defaultFilterChain")
    return [*listener.get("filterChains", []), *([{**default, "name": default.get("name", "") + " (default)"}]
                                                  if default else [])]


def _alpn(socket: dict[str, Any] | None) -> list[str] | None:
    if not socket:
        return None
    config = socket.get("typedConfig", {})
    return config.get("commonTlsContext", {}).get("alpnProtocols", []) if "commonTlsContext" in config else [
        f"({socket.get('name')})"]


def shape(type_url: str, resource: dict[str, Any]) -> Any:
    """What a client tells apart: chains and their matches, filters, ALPN; virtual hosts' domains."""
    if type_url == LISTENER:
        return {
            "address": resource.get("address"),
            "listenerFilters": [f.get("name") for f in resource.get("listenerFilters", [])],
            "chains": [{
                "name": chain.get("name"),
                "match": chain.get("filterChainMatch", {}),
                "filters": [f.get("name") + (f" rds={f['typedConfig']['rds']['routeConfigName']}"
                                             if "rds" in f.get("typedConfig", {}) else "")
                            + (f" -> {f['typedConfig'].get('cluster')}" if "cluster" in f.get("typedConfig", {}) else "")
                            for f in chain.get("filters", [])],
                "alpn": _alpn(chain.get("transportSocket")),
            } for chain in _chains(resource)],
        }
    if type_url == ROUTE:
        return {host.get("name"): host.get("domains") for host in resource.get("virtualHosts", [])}
    alpn = [_alpn(m.get("transportSocket")) for m in resource.get("transportSocketMatches", [])]
    return {"type": resource.get("type", resource.get("clusterType", {}).get("name", "EDS?")),
            "alpn": _alpn(resource.get("transportSocket")), "matchAlpn": alpn or None}


def diff(istio: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]], full: bool) -> int:
    differences = 0
    for type_url in (LISTENER, ROUTE, CLUSTER):
        short = type_url.rsplit(".", 1)[-1]
        for name in sorted(istio[type_url].keys() | ours[type_url].keys()):
            theirs, mine = istio[type_url].get(name), ours[type_url].get(name)
            if theirs is None or mine is None:
                differences += 1
                print(f"--- {short} {name}: only {'ours' if theirs is None else 'Istio'}'s")
                continue
            if not full:
                theirs, mine = shape(type_url, theirs), shape(type_url, mine)
            if theirs == mine:
                continue
            differences += 1
            print(f"--- {short} {name}")
            if type_url == LISTENER and not full:
                _diff_chains(theirs, mine)
                continue
            print_fields(theirs, mine)
    print(f"{sum(len(v) for v in istio.values())} resources from Istio, {sum(len(v) for v in ours.values())} "
          f"from ours; {differences} differ")
    return differences


def _diff_chains(theirs: dict[str, Any], mine: dict[str, Any]) -> None:
    for key in ("address", "listenerFilters"):
        if theirs[key] != mine[key]:
            print(f"  {key}: Istio {json.dumps(theirs[key])}\n  {' ' * len(key)}  ours  {json.dumps(mine[key])}")
    same = [c for c in theirs["chains"] if c in mine["chains"]]
    print(f"  {len(same)} filter chains alike")
    for chain in theirs["chains"]:
        if chain not in mine["chains"]:
            print(f"  Istio: {json.dumps(chain, sort_keys=True)}")
    for chain in mine["chains"]:
        if chain not in theirs["chains"]:
            print(f"  ours:  {json.dumps(chain, sort_keys=True)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_reference_argument(parser)
    parser.add_argument("--mesh", type=Path,
                        default=Path(__file__).parent.parent / "tests" / "data" / "sidecar-shape-mesh.yaml")
    parser.add_argument("--node", default=NODE, help="the sidecar's node ID")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                        help="a label of the proxy (a gateway's `istio=ingressgateway`)")
    parser.add_argument("--full", action="store_true", help="compare every field, not the shape")
    parser.add_argument("--dump", type=Path, help="write both sides' resources as JSON into this directory")
    args = parser.parse_args()
    binary = reference_binary(parser, args)
    # Istio-only filters upstream Envoy NACKs: off, as a working Istio mesh on upstream Envoy has them.
    os.environ.update(PILOT_ENABLE_METADATA_EXCHANGE="false", PILOT_ENABLE_ALPN_FILTER="false")
    with side_by_side(binary, args.mesh, "sidecar-compare-") as (reference_addr, our_addr):
        labels = dict(label.split("=", 1) for label in args.label)
        istio_held, our_held = (asyncio.run(held(reference_addr, args.node, labels)),
                                asyncio.run(held(our_addr, args.node, labels)))
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            for side, resources in (("istio", istio_held), ("ours", our_held)):
                (args.dump / f"{side}.json").write_text(json.dumps(resources, indent=1, sort_keys=True))
        differences = diff(istio_held, our_held, args.full)
    sys.exit(1 if differences else 0)


if __name__ == "__main__":
    main()

"""Any Gateway API object either converts or is refused with ConversionError (never another
exception, which would stop a source), and whatever converts, the Gateway's proxy is sent route
configurations Envoy accepts: every regex RE2 compiles, every route has an action."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import yaml
from envoy.config.route.v3 import route_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from istiod.model.builder import build_snapshot
from istiod.model.config.common import compile_regex
from istiod.model.proxy import proxy_from_node
from istiod.sources.convert import ConversionError
from istiod.sources.store import Store
from istiod.xds import types
from istiod.xds.cache import ResourceCache
from istiod.xds.gen import ROUTER
from tests.conftest import render
from tests.test_istio_fuzz import paths, values

DOCUMENTS = list(yaml.safe_load_all(render(
    "gateway-api-mesh.yaml", http_port=8080, https_port=8443, other_port=9443, app_port=9000, v1_ip="127.0.0.41",
    v2_ip="127.0.0.42", grpc_ip="127.0.0.43", grpc_port=9001)))
GATEWAY_API = [i for i, d in enumerate(DOCUMENTS) if d["apiVersion"].startswith("gateway.networking.k8s.io/")]
PROXY = dataclasses.replace(proxy_from_node("router~127.0.0.70~web-1.istio-ingress~istio-ingress.svc.cluster.local",
                                            {"LABELS": {"gateway.networking.k8s.io/gateway-name": "web"}}),
                            verified=True)
patterns = st.sampled_from(["/(?=x)", "[", "/a.*", "(a|b)+", "\\pL", "^/$", "/x{1000}{1000}", ""])


def _regexes(message: Any) -> list[str]:
    found = []
    for field, value in message.ListFields():
        if field.name == "regex" and isinstance(value, str):
            found.append(value)
        elif field.type == field.TYPE_MESSAGE:
            items = value if isinstance(value, (list, tuple)) or hasattr(value, "__len__") else [value]
            for item in items:
                if hasattr(item, "ListFields"):
                    found += _regexes(item)
    return found


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(GATEWAY_API), st.data(), st.one_of(values, patterns))
def test_any_field_replaced_by_anything_never_reaches_a_proxy_broken(index: int, data: st.DataObject,
                                                                     value: Any) -> None:
    body = copy.deepcopy(DOCUMENTS[index])
    path = data.draw(st.sampled_from([p for p in paths(body["spec"]) if p]))
    target = body["spec"]
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    store = Store()
    for document in DOCUMENTS:
        store.apply(document)
    try:
        store.apply(body)
    except ConversionError:
        pass  # refused, naming the field: the last good object stays
    snapshot = build_snapshot(store, "v1")
    for resource in ROUTER[types.ROUTE](snapshot, PROXY, None, ResourceCache()):
        config = route_pb2.RouteConfiguration.FromString(resource.value)
        for host in config.virtual_hosts:
            assert len(set(host.domains)) == len(host.domains)
            for route in host.routes:
                assert route.WhichOneof("action") is not None
        for pattern in _regexes(config):
            compile_regex(pattern)  # Envoy compiles it with RE2 too

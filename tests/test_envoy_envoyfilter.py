"""EnvoyFilter on a real Envoy sidecar (the pod of tests/test_envoy_routing.py: web-1 calling
Service echo through its captured sidecar): a Lua HTTP filter inserted before the router, a virtual
host and a route patched in, a cluster merged; all seen by curl or in Envoy's config dump, and gone
with the object. A patch naming a type Envoy does not know is refused by istiod, and the sidecar
keeps its last good config."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.peers import wait_until
from tests.test_envoy_routing import ECHO, Pod
from tests.test_envoy_routing import pod as pod  # noqa: F401 (the module's fixture)
from tests.test_envoy_sidecar import _dynamic

FILTER = """apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {name: web-patches, namespace: shop}
spec:
  workloadSelector: {labels: {app: web}}
  configPatches:
  - applyTo: HTTP_FILTER
    match:
      context: SIDECAR_OUTBOUND
      listener:
        portNumber: 80
        filterChain:
          filter:
            name: envoy.filters.network.http_connection_manager
            subFilter: {name: envoy.filters.http.router}
    patch:
      operation: INSERT_BEFORE
      value:
        name: envoy.filters.http.lua
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
          default_source_code:
            inline_string: |
              function envoy_on_response(handle)
                handle:headers():add("x-lua", "from-envoyfilter")
              end
  - applyTo: VIRTUAL_HOST
    match: {context: SIDECAR_OUTBOUND, routeConfiguration: {portNumber: 80, vhost: {name: "echo.shop.svc.cluster.local:80"}}}
    patch: {operation: MERGE, value: {response_headers_to_add: [{header: {key: x-vhost, value: patched}}]}}
  - applyTo: HTTP_ROUTE
    match: {context: SIDECAR_OUTBOUND, routeConfiguration: {vhost: {name: "echo.shop.svc.cluster.local:80"}}}
    patch:
      operation: INSERT_FIRST
      value: {name: teapot, match: {prefix: /teapot}, direct_response: {status: 418, body: {inline_string: short and stout}}}
  - applyTo: CLUSTER
    match: {context: SIDECAR_OUTBOUND, cluster: {service: echo.shop.svc.cluster.local, portNumber: 80}}
    patch: {operation: MERGE, value: {connect_timeout: 7s}}
"""
UNKNOWN_TYPE = """apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {name: broken, namespace: shop}
spec:
  configPatches:
  - applyTo: HTTP_FILTER
    patch:
      operation: ADD
      value: {name: x, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.nothing.v3.Nothing}}
"""


@pytest.fixture
def patched(pod: Pod) -> Iterator[Pod]:  # noqa: F811
    (pod.config / "envoyfilter.yaml").write_text(FILTER)
    try:
        yield pod
    finally:
        (pod.config / "envoyfilter.yaml").unlink(missing_ok=True)
        (pod.config / "broken.yaml").unlink(missing_ok=True)


def _headers(pod: Pod, path: str = "/") -> tuple[str, dict[str, str]]:
    text = pod.curl("-i", url=f"http://10.96.0.20{path}")
    head = text.replace("\r\n", "\n").partition("\n\n")[0].splitlines()
    fields = dict((k.lower(), v.strip()) for k, _, v in (line.partition(":") for line in head[1:]))
    return head[0], fields


def test_patches_reach_the_sidecar_and_leave_with_the_object(patched: Pod) -> None:
    pod = patched
    wait_until(lambda: _headers(pod)[1].get("x-lua") == "from-envoyfilter", 20, "the Lua filter in the sidecar")
    status, headers = _headers(pod)
    print(f"GET / through the patched sidecar: {status} x-lua={headers.get('x-lua')} x-vhost={headers.get('x-vhost')}")
    assert status.split()[1] == "200" and headers["x-vhost"] == "patched"
    teapot = pod.curl("-w", " %{http_code}", url="http://10.96.0.20/teapot")
    print(f"GET /teapot: {teapot}")
    assert teapot == "short and stout 418"
    clusters = _dynamic(pod.envoy.config_dump(), "clusters")
    assert clusters[f"outbound|80||{ECHO}"]["connect_timeout"] == "7s"
    # A patch istiod refuses: logged, the object left out, the sidecar's config as it was.
    (pod.config / "broken.yaml").write_text(UNKNOWN_TYPE)
    wait_until(lambda: "EnvoyFilter shop/broken" in pod.istiod.text(), 10, "istiod to refuse the broken EnvoyFilter")
    line = next(x for x in pod.istiod.text().splitlines() if "EnvoyFilter shop/broken" in x)
    print(f"istiod: {line}")
    assert "referenced type unknown: envoy.extensions.filters.http.nothing.v3.Nothing" in line
    assert _headers(pod)[1].get("x-lua") == "from-envoyfilter"
    (pod.config / "envoyfilter.yaml").unlink()
    wait_until(lambda: "x-lua" not in _headers(pod)[1], 20, "the sidecar without the EnvoyFilter")
    assert "x-vhost" not in _headers(pod)[1] and '"name"' in pod.curl(url="http://10.96.0.20/teapot")

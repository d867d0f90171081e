"""What Istio's own istiod and ours send an ingress gateway for TLS passthrough and TCP servers (a dev
tool: it needs Istio's pilot-discovery, built by shared/reference-istiod/build.sh, which CI does not
have).

    python bench/gateway_tls_compare.py [--reference PATH]

etcd and kube-apiserver are started (the e2e harness), Istio's CRDs installed, and an Istio Gateway
selecting `istio: ingressgateway` created, with a TLS server in PASSTHROUGH mode, a TCP server and
an HTTPS server in MUTUAL mode, an AUTO_PASSTHROUGH server, an HTTPS server in MUTUAL mode with two
credentialNames and client SPKI/hash pins, HTTPS servers with certificates from files (SIMPLE, MUTUAL
with caCertificates, OPTIONAL_MUTUAL with tlsCertificates), and a VirtualService with `tls` (by SNI), `tcp` and `http` routes to
one Service. Each istiod in turn is asked for the listeners of a router node with those labels
(plaintext xDS); each listener is printed as a summary (address, listener filters, and per filter
chain its match, TLS context and network filters) side by side, marking what differs. Every
process started here is stopped at the end, on failure and Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))
from e2e.harness import Cluster  # noqa: E402
from e2e.istio_crds import install_crds  # noqa: E402
from istiod.kubeapi import api_client  # noqa: E402
from reference import add_reference_argument, reference_binary, start_reference  # noqa: E402
from envoy.config.listener.v3 import listener_pb2  # noqa: E402
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2  # noqa: E402
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from tests.ads_client import AdsClient  # noqa: E402
from tests.peers import Istiod, stop_group  # noqa: E402
from tests.test_gateway_gen import server_credential, tls_secret  # noqa: E402

OBJECTS = """
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: edge, namespace: gw-ingress}
spec:
  selector: {istio: ingressgateway}
  servers:
  - port: {number: 443, name: tls, protocol: TLS}
    hosts: [gw-shop/tls.example.com]
    tls: {mode: PASSTHROUGH}
  - port: {number: 9000, name: tcp, protocol: TCP}
    hosts: [gw-shop/*]
  - port: {number: 8443, name: https, protocol: HTTPS}
    hosts: [gw-shop/secure.example.com]
    tls: {mode: MUTUAL, credentialName: web-cert}
  - port: {number: 15443, name: tls-auto, protocol: TLS}
    hosts: ["*.local"]
    tls: {mode: AUTO_PASSTHROUGH}
  - port: {number: 8444, name: https-pinned, protocol: HTTPS}
    hosts: [gw-shop/secure.example.com]
    tls:
      mode: MUTUAL
      credentialNames: [web-cert, web-cert-2]
      verifyCertificateSpki: [AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=]
      verifyCertificateHash: ["AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB:AB"]
  - port: {number: 8445, name: https-files, protocol: HTTPS}
    hosts: [gw-shop/secure.example.com]
    tls: {mode: SIMPLE, serverCertificate: /etc/gw/tls.crt, privateKey: /etc/gw/tls.key}
  - port: {number: 8446, name: https-files-mutual, protocol: HTTPS}
    hosts: [gw-shop/secure.example.com]
    tls: {mode: MUTUAL, serverCertificate: /etc/gw/tls.crt, privateKey: /etc/gw/tls.key, caCertificates: /etc/gw/ca.crt,
          subjectAltNames: [client.example.com], caCrl: /etc/gw/ca.crl}
  - port: {number: 8447, name: https-files-pair, protocol: HTTPS}
    hosts: [gw-shop/secure.example.com]
    tls:
      mode: OPTIONAL_MUTUAL
      caCertificates: /etc/gw/ca.crt
      tlsCertificates: [{serverCertificate: /etc/gw/rsa.crt, privateKey: /etc/gw/rsa.key},
                        {serverCertificate: /etc/gw/ec.crt, privateKey: /etc/gw/ec.key}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: app, namespace: gw-shop}
spec:
  hosts: [tls.example.com, secure.example.com, app.gw-shop.svc.cluster.local]
  gateways: [gw-ingress/edge]
  tls: [{match: [{sniHosts: [tls.example.com]}], route: [{destination: {host: app.gw-shop.svc.cluster.local, port: {number: 443}}}]}]
  tcp: [{match: [{port: 9000}], route: [{destination: {host: app.gw-shop.svc.cluster.local, port: {number: 443}}}]}]
  http: [{route: [{destination: {host: app.gw-shop.svc.cluster.local, port: {number: 80}}}]}]
"""
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
NODE = "router~10.244.0.90~ingress-1.gw-ingress~gw-ingress.svc.cluster.local"


async def setup(api: client.ApiClient) -> None:
    await install_crds(api)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    for namespace in ("gw-ingress", "gw-shop"):
        await core.create_namespace({"metadata": {"name": namespace}})
    await core.create_namespaced_service("gw-shop", {"metadata": {"name": "app"}, "spec": {
        "selector": {"app": "app"}, "ports": [{"name": "tls", "port": 443}, {"name": "http", "port": 80}]}})
    ca, cert, key = server_credential("secure.example.com")
    secret = tls_secret("web-cert", "gw-ingress", cert, key)
    secret["data"]["ca.crt"] = secret["data"]["tls.crt"]
    await core.create_namespaced_secret("gw-ingress", secret)
    await core.create_namespaced_secret("gw-ingress", tls_secret("web-cert-2", "gw-ingress", cert, key))
    for body in yaml.safe_load_all(OBJECTS):
        group, _, version = body["apiVersion"].partition("/")
        plural = body["kind"].lower() + "s"
        await custom.create_namespaced_custom_object(group, version, body["metadata"]["namespace"], plural, body)


def _typed(any_message: Any, message_type: Any) -> dict[str, Any]:
    if any_message.type_url.endswith("/" + message_type.DESCRIPTOR.full_name):
        return json_format.MessageToDict(message_type.FromString(any_message.value))
    return {"@type": any_message.type_url.rpartition("/")[2]}


def summary(listener: listener_pb2.Listener) -> dict[str, Any]:
    chains = []
    for chain in listener.filter_chains:
        chains.append({
            "name": chain.name,
            "match": json_format.MessageToDict(chain.filter_chain_match),
            "tls": _typed(chain.transport_socket.typed_config, tls_pb2.DownstreamTlsContext)
            if chain.HasField("transport_socket") else None,
            "filters": [{"name": f.name, **(_typed(f.typed_config, tcp_proxy_pb2.TcpProxy)
                                            if f.name == "envoy.filters.network.tcp_proxy" else {})}
                        for f in chain.filters]})
    return {"address": json_format.MessageToDict(listener.address),
            "listener_filters": [f.name for f in listener.listener_filters], "filter_chains": chains}


async def gateway_listeners(xds_address: str, want: int = 8) -> dict[str, Any]:
    """The node's listeners once `want` of them are sent (the config may still be arriving)."""
    result: dict[str, Any] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ads = AdsClient(xds_address, NODE, "gw-ingress", istio_version="1.31.0")
        del ads.node.metadata.fields["GENERATOR"]
        ads.node.metadata.update({"LABELS": {"istio": "ingressgateway"}, "CLUSTER_ID": "Kubernetes"})
        try:
            response = await ads.subscribe(LISTENER, [])
        finally:
            await ads.close()
        result = {}
        for resource in response.resources:
            listener = listener_pb2.Listener.FromString(resource.value)
            result[listener.name] = summary(listener)
        if len(result) >= want:
            break
        await asyncio.sleep(1)
    return result


def compare(theirs: dict[str, Any], ours: dict[str, Any]) -> int:
    differences = 0
    for name in sorted(theirs.keys() | ours.keys()):
        a, b = theirs.get(name), ours.get(name)
        if a == b:
            print(f"== {name} (same)\n{json.dumps(a, indent=1)}")
            continue
        differences += 1
        print(f"!! {name}\n-- istio:\n{json.dumps(a, indent=1)}\n-- ours:\n{json.dumps(b, indent=1)}")
    return differences


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_reference_argument(parser)
    args = parser.parse_args()
    args.reference = reference_binary(parser, args)
    workdir = Path(tempfile.mkdtemp(prefix="gw-tls-compare-"))
    (workdir / "cluster").mkdir()
    cluster = Cluster(workdir / "cluster")
    reference = ours = None
    try:
        cluster.start()
        async with await api_client(cluster.kubeconfig) as api:
            await setup(api)
        reference, reference_xds, _ = start_reference(args.reference, cluster.kubeconfig, workdir)
        theirs = await gateway_listeners(reference_xds)
        stop_group(reference, grace=5)
        reference = None
        ours = Istiod(workdir, "--kubeconfig", str(cluster.kubeconfig), ready_timeout=60)
        mine = await gateway_listeners(ours.xds_address)
        return 1 if compare(theirs, mine) else 0
    finally:
        if reference is not None:
            stop_group(reference, grace=5)
        if ours is not None:
            ours.stop()
        cluster.stop()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

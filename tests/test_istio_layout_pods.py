"""Pods injected with Istio's own layout (the injector config's `layout: istio`) run as a kubelet
would run them, with Istio's REAL pilot-agent and a real Envoy, against istiod (tests/istio_pods.py):
certificates from its CA, config from its xDS, capture by istio-init's args, an mTLS call between the
pods, and an app's HTTP readiness probe answered through the agent's 15020 under STRICT mTLS.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from cryptography import x509

from tests.conftest import synced
from tests.istio_pods import A_ID, HOST, NAMESPACE, XDS_TYPES, Pods, injected, istio_pods, proxy_id
from tests.peers import istio_binary, wait_until
from tests.pods import admin, call, requires_root

pytestmark = requires_root


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    with istio_pods(tmp_path_factory.mktemp("istio-layout")) as running:
        yield running


def test_config_from_istiod_and_a_certificate_from_its_ca(pods: Pods) -> None:
    wait_until(lambda: synced(pods.istiod, proxy_id("a-1", "10.44.0.2"), XDS_TYPES)
               and synced(pods.istiod, proxy_id("b-1", "10.44.0.3"), XDS_TYPES), 60, "both pilot-agents synced")
    certs = json.loads(admin(pods.b, "/certs"))["certificates"]
    chains = [c for entry in certs for c in entry.get("cert_chain") or []]
    assert any(san.get("uri") == f"spiffe://cluster.local/ns/{NAMESPACE}/sa/b"
               for c in chains for san in c.get("subject_alt_names") or []), certs
    root = x509.load_pem_x509_certificate(pods.istiod.root_cert.read_bytes())
    ca = [c for entry in certs for c in entry.get("ca_cert") or []]
    assert any(int(c["serial_number"], 16) == root.serial_number for c in ca), (ca, root.serial_number)


def test_a_calls_b_over_mtls_through_both_captures(pods: Pods) -> None:
    reply = call(pods.a, "http-get", f"http://{HOST}:8080/hello")
    print("a-1 -> b-1:", reply)
    assert reply["ok"], reply
    assert f"URI={A_ID}" in reply["body"]["headers"].get("x-forwarded-client-cert", "")


def test_readiness_probe_is_answered_through_the_agents_status_port(pods: Pods) -> None:
    container = pods.specs["b-1"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/app-health/app/readyz", "port": 15020}
    kubelet = pods.node.ns  # the kubelet probes from the node
    probe = kubelet.run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5",
                        "http://10.44.0.3:15020/app-health/app/readyz")
    assert probe.stdout == "200", probe
    direct = kubelet.run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5",
                         "http://10.44.0.3:8080/ready")  # what the kubelet would do unrewritten: STRICT refuses it
    assert direct.stdout != "200", direct


def test_istio_init_args_installed_istios_capture(pods: Pods) -> None:
    rules = pods.a.run("iptables-save").stdout + pods.a.run("iptables-legacy-save").stdout
    assert "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001" in rules, rules
    assert "-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006" in rules, rules
    assert "--uid-owner 1337 -j RETURN" in rules, rules


def test_hold_application_hook_returns_once_the_proxy_is_ready(pods: Pods) -> None:
    """The postStart hook the layout gives a held pod, run in b-1 as the kubelet would exec it."""
    held = json.loads(json.dumps(pods.specs["b-1"]))
    held["metadata"]["annotations"] = {"proxy.istio.io/config": "holdApplicationUntilProxyStarts: true"}
    for key in ("initContainers", "volumes"):
        held["spec"].pop(key)
    held["spec"]["containers"] = [c for c in held["spec"]["containers"] if c["name"] != "istio-proxy"]
    held["metadata"]["annotations"].pop("sidecar.istio.io/status", None)
    proxy = injected(held)["spec"]["containers"][0]
    assert proxy["name"] == "istio-proxy"  # first: the apps start after its hook returns
    command = proxy["lifecycle"]["postStart"]["exec"]["command"]
    assert command == ["pilot-agent", "wait"]
    done = pods.b.run(istio_binary("pilot-agent"), *command[1:], timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

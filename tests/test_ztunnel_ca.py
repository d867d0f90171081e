"""The real ztunnel (shared mode, as on a node) gets its node's workloads' certificates from istiod's CA:
it asks for each HBONE workload of its node naming it in `ImpersonatedIdentity`, with its pod-bound
token; istiod signs for the workload's identity. A ztunnel whose token is bound to a pod on another
node, asking for the same workload, is refused, and holds no certificate for it.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from istiod.ca.pki import load_certs, uri_sans
from istiod.demo.pods import Netns
from tests.peers import Process, wait_until
from tests.pods import netns, requires_root
from tests.test_ca_chaining import assert_chains_by_key_id
from tests.test_ztunnel import Mesh
from tests.ztunnel_peer import Ztunnel, ztunnel_binary

pytestmark = requires_root
ECHO = "spiffe://cluster.local/ns/ambient/sa/echo"  # echo-1, HBONE on node-a in tests/data/ambient-mesh.yaml
TOKENS = {"zt-node-a": "ztunnel-a", "zt-node-b": "ztunnel-b"}  # token -> the ztunnel pod it is bound to


def ztunnel_pod(name: str, node: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "istio-system", "uid": f"uid-{name}"},
            "spec": {"serviceAccountName": "ztunnel", "nodeName": node, "hostNetwork": True,
                     "containers": [{"name": "istio-proxy"}]},
            "status": {"phase": "Running", "podIP": "10.244.0.250"}}


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Netns, Process, Path]]:
    """istiod in a network namespace of its own (ztunnel's ports are fixed), the ambient mesh, two
    nodes, a ztunnel pod on each, and static tokens bound to those pods."""
    binary = ztunnel_binary()
    mesh = Mesh(tmp_path / "config")
    mesh.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-b"}})
    mesh.put(ztunnel_pod("ztunnel-a", "node-a"))
    mesh.put(ztunnel_pod("ztunnel-b", "node-b"))
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({token: {"serviceAccount": "istio-system/ztunnel", "pod": pod, "podUID": f"uid-{pod}"}
                                  for token, pod in TOKENS.items()}))
    with netns("ztunnel-ca") as pod:
        istiod = Process(pod.exec_args(
            sys.executable, "-m", "istiod", "--log-format", "kv", "discovery", "--config-dir", str(mesh.root),
            "--grpc-addr", "127.0.0.1:15010", "--http-addr", "127.0.0.1:8080", "--monitoring-addr", "127.0.0.1:15014",
            "--secure-grpc-addr", "127.0.0.1:15012", "--webhook-addr", "127.0.0.1:15017",
            "--ca-state-dir", str(tmp_path / "state"), "--ca-static-tokens", str(tokens),
            "--tls-extra-san", "127.0.0.1"), name="istiod")
        try:
            wait_until(lambda: pod.run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                       "http://127.0.0.1:8080/ready").stdout == "200", 30, "istiod /ready", 0.2)
            yield pod, istiod, Path(binary)
        finally:
            istiod.stop()


def shared_ztunnel(binary: Path, pod: Netns, workdir: Path, token: str, pod_name: str) -> Ztunnel:
    """A node's ztunnel as the chart runs it (shared mode, the CA on istiod's 15012), on node-a as far as
    it knows: what decides is the pod its token is bound to. No istio-cni runs: it only waits for one."""
    root = str(workdir.parent / "state" / "root-cert.pem")
    return Ztunnel(str(binary), pod, workdir, {
        "FAKE_CA": "false", "PROXY_MODE": "shared", "XDS_ADDRESS": "https://127.0.0.1:15012", "XDS_ROOT_CA": root,
        "CA_ADDRESS": "https://127.0.0.1:15012", "CA_ROOT_CA": root, "AUTH_TOKEN": token, "POD_NAME": pod_name,
        "POD_NAMESPACE": "istio-system", "INSTANCE_IP": "10.244.0.250", "NODE_NAME": "node-a"})


def certificates(ztunnel: Ztunnel) -> dict[str, list[Any]]:
    code, body = ztunnel.get("/config_dump")
    return {c["identity"]: c.get("certChain") or [] for c in json.loads(body).get("certificates", [])} if code == 200 else {}


def test_real_ztunnel_gets_its_nodes_workload_certificates_and_not_another_nodes(
        world: tuple[Netns, Process, Path], tmp_path: Path) -> None:
    pod, istiod, binary = world
    ztunnel = shared_ztunnel(binary, pod, tmp_path / "zt-a", "zt-node-a", "ztunnel-a")
    try:
        chain = wait_until(lambda: certificates(ztunnel).get(ECHO), 30, "echo's certificate in ztunnel's config_dump")
    except AssertionError:
        raise AssertionError(f"ztunnel:\n{ztunnel.log()[-4000:]}\nistiod:\n{istiod.log()[-4000:]}") from None
    finally:
        ztunnel.stop()
    leaf = load_certs(base64.b64decode(chain[0]["pem"]), "ztunnel's certificate")[0]
    root = load_certs((tmp_path / "state" / "root-cert.pem").read_bytes(), "root")[0]
    assert uri_sans(leaf) == [ECHO]
    assert_chains_by_key_id(leaf, root)
    leaf.verify_directly_issued_by(root)
    assert f"issued a certificate for {ECHO} (by StaticTokenAuthenticator, on behalf of node account " \
           "istio-system/ztunnel)" in istiod.text()

    # Another node's ztunnel (its token bound to ztunnel-b on node-b) claiming node-a's workload.
    forged = shared_ztunnel(binary, pod, tmp_path / "zt-b", "zt-node-b", "ztunnel-b")
    try:
        wait_until(lambda: "impersonation denied" in istiod.text(), 30, "istiod's refusal")
        refusal = "no pod of service account ambient/echo runs on node 'node-b'"
        wait_until(lambda: refusal in forged.text(), 10, "ztunnel told why")
        assert ECHO not in certificates(forged) or not certificates(forged)[ECHO]
    finally:
        forged.stop()
    line = next(line for line in forged.text().splitlines() if refusal in line)
    print(f"the forged ztunnel's log: {line}")
    assert "does not have permission" in line  # PERMISSION_DENIED, as ztunnel's gRPC client words it

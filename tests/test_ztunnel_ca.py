"""The real ztunnel (shared mode, as on a node) gets its node's workloads' certificates from istiod's CA:
it asks for each HBONE workload of its node naming it in `ImpersonatedIdentity`, with its pod-bound
token; istiod signs for the workload's identity. A ztunnel whose token is bound to a pod on another
node, asking for the same workload, is refused, and holds no certificate for it.
"""

from __future__ import annotations

import base64
import json
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
from tests.ztunnel_peer import Ztunnel, istiod_for_ztunnels, node_tokens, shared_env, ztunnel_binary, ztunnel_pod

pytestmark = requires_root
ECHO = "spiffe://cluster.local/ns/ambient/sa/echo"  # echo-1, HBONE on node-a in tests/data/ambient-mesh.yaml
TOKENS = {"zt-node-a": "ztunnel-a", "zt-node-b": "ztunnel-b"}  # token -> the ztunnel pod it is bound to


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Netns, Process, Path]]:
    """istiod in a network namespace of its own (ztunnel's ports are fixed), the ambient mesh, two
    nodes, a ztunnel pod on each, and static tokens bound to those pods."""
    binary = ztunnel_binary()
    mesh = Mesh(tmp_path / "config")
    mesh.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-b"}})
    mesh.put(ztunnel_pod("ztunnel-a", "node-a"))
    mesh.put(ztunnel_pod("ztunnel-b", "node-b"))
    tokens = node_tokens(tmp_path / "tokens.json", TOKENS)
    with netns("ztunnel-ca") as pod:
        istiod = istiod_for_ztunnels(pod, mesh.root, tmp_path / "state", tokens)
        try:
            yield pod, istiod, Path(binary)
        finally:
            istiod.stop()


def shared_ztunnel(binary: Path, pod: Netns, workdir: Path, token: str, pod_name: str) -> Ztunnel:
    """A node's ztunnel as the chart runs it (shared mode, the CA on istiod's 15012), on node-a as far as
    it knows: what decides is the pod its token is bound to. No istio-cni runs: it only waits for one."""
    return Ztunnel(str(binary), pod, workdir,
                   shared_env(workdir.parent / "state", "127.0.0.1:15012", token, pod_name, "node-a"))


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

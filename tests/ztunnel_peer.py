"""The real ztunnel as a test peer: its binary, and one run in a network namespace (its ports are fixed).

Dedicated mode (one workload, no istio-cni) with FAKE_CA (it mints its own certificates): what is under
test is its WDS client, against istiod's secure port with a bearer token, as a ztunnel connects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from istiod.demo.pods import Netns
from tests.peers import ROOT, Process, stop_group, wait_until

BUILD_TIMEOUT = 1200  # a cold build is ~5 minutes on 2 cores
MADE = ROOT / ".cache" / "ztunnel-bin" / "ztunnel"


def ztunnel_binary() -> str:
    """$ZTUNNEL, else the one `make ztunnel-bin` linked into .cache/ztunnel-bin, else what
    `shared/ztunnel/build.sh` beside the checkout builds (cached after the first)."""
    given = os.environ.get("ZTUNNEL")
    if given:
        return given
    if os.access(MADE, os.X_OK):
        return str(MADE)
    script = next((p / "shared" / "ztunnel" / "build.sh" for p in ROOT.parents
                   if (p / "shared" / "ztunnel" / "build.sh").exists()), None)
    if script is None:
        raise AssertionError("no ztunnel: set ZTUNNEL, or put shared/ztunnel/build.sh beside the checkout")
    built = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    if built.returncode != 0:
        raise AssertionError(f"building ztunnel failed:\n{built.stderr[-4000:]}")
    return built.stdout.strip().splitlines()[-1]


class Ztunnel(Process):
    """One ztunnel inside `pod`, run from an empty directory (it reads ./var/run/secrets defaults)."""

    def __init__(self, binary: str, pod: Netns, workdir: Path, env: dict[str, str]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.pod = pod
        settings = {"RUST_LOG": "info,ztunnel::xds=debug", "FAKE_CA": "true", "PROXY_MODE": "dedicated", **env}
        super().__init__(pod.exec_args("env", "-C", str(workdir), *(f"{k}={v}" for k, v in settings.items()),
                                       binary), name="ztunnel")

    def get(self, path: str, port: int = 15000) -> tuple[int, str]:
        done = self.pod.run("curl", "-s", "-w", "\n%{http_code}", f"http://127.0.0.1:{port}{path}", timeout=10)
        body, _, code = done.stdout.rpartition("\n")
        return int(code or 0), body

    def ready(self) -> bool:
        return self.get("/healthz/ready", 15021)[0] == 200

    def wait_ready(self, timeout: float = 30) -> None:
        try:
            wait_until(self.ready, timeout, "ztunnel /healthz/ready", interval=0.2)
        except AssertionError:
            raise AssertionError(f"ztunnel not ready; log:\n{self.log()}") from None

    def config_dump(self) -> dict[str, Any]:
        code, body = self.get("/config_dump")
        assert code == 200, body
        return json.loads(body)  # type: ignore[no-any-return]

    def stop(self) -> None:
        # Before its first xDS state a SIGTERM does not end it: stop_group follows up with SIGKILL.
        stop_group(self.proc, grace=3)


def istiod_for_ztunnels(pod: Netns, config: Path, state: Path, tokens: Path, *extra: str,
                 secure: str = "127.0.0.1:15012") -> Process:
    """istiod inside `pod`'s namespace on its usual ports (xDS and CA for ztunnels on `secure`), its CA
    state in `state` (kept across restarts), `tokens` its static bearer tokens; ready when returned."""
    istiod = Process(pod.exec_args(
        sys.executable, "-m", "istiod", "--log-format", "kv", "discovery", "--config-dir", str(config),
        "--grpc-addr", "127.0.0.1:15010", "--http-addr", "127.0.0.1:8080", "--monitoring-addr", "127.0.0.1:15014",
        "--secure-grpc-addr", secure, "--webhook-addr", "127.0.0.1:15017", "--ca-state-dir", str(state),
        "--ca-static-tokens", str(tokens), "--tls-extra-san", secure.rpartition(":")[0], *extra), name="istiod")
    try:
        wait_until(lambda: pod.run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                   "http://127.0.0.1:8080/ready").stdout == "200", 30, "istiod /ready", 0.2)
    except BaseException:
        istiod.stop()
        raise
    return istiod


def ztunnel_pod(name: str, node: str) -> dict[str, Any]:
    """A node's ztunnel pod, as the chart runs it: what a node-bound token names."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "istio-system", "uid": f"uid-{name}"},
            "spec": {"serviceAccountName": "ztunnel", "nodeName": node, "hostNetwork": True,
                     "containers": [{"name": "istio-proxy"}]},
            "status": {"phase": "Running", "podIP": "10.244.0.250"}}


def node_tokens(path: Path, tokens: dict[str, str]) -> Path:
    """istiod's static tokens (`--ca-static-tokens`): each token -> the ztunnel pod it is bound to."""
    path.write_text(json.dumps({token: {"serviceAccount": "istio-system/ztunnel", "pod": pod, "podUID": f"uid-{pod}"}
                                for token, pod in tokens.items()}))
    return path


def shared_env(state: Path, istiod: str, token: str, pod_name: str, node: str) -> dict[str, str]:
    """A node's ztunnel (shared mode) with xDS and its workloads' certificates from istiod at `istiod`
    (no FAKE_CA), with `token`, as pod `pod_name` of `node`."""
    root, url = str(state / "root-cert.pem"), f"https://{istiod}"
    return {"FAKE_CA": "false", "PROXY_MODE": "shared", "XDS_ADDRESS": url, "XDS_ROOT_CA": root,
            "CA_ADDRESS": url, "CA_ROOT_CA": root, "AUTH_TOKEN": token, "POD_NAME": pod_name,
            "POD_NAMESPACE": "istio-system", "INSTANCE_IP": "10.244.0.250", "NODE_NAME": node}

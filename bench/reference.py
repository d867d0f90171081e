"""Istio's own istiod (pilot-discovery, built by shared/reference-istiod/build.sh) on the e2e
kube-apiserver, to compare with: a dev tool, CI has no such binary."""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.peers import free_port, stop_group


def built_reference() -> str | None:
    """The pilot-discovery that build.sh cached, if any."""
    return next(iter(sorted(glob.glob(os.path.expanduser("~/.cache/real-istiod/*/pilot-discovery")))), None)


def add_reference_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reference", help="Istio's pilot-discovery (default: the one build.sh cached)")


def reference_binary(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """--reference, else the cached build; the tool stops with one line when there is neither."""
    binary: str | None = args.reference or built_reference()
    if not binary:
        parser.error("no Istio pilot-discovery: build it with shared/reference-istiod/build.sh or give --reference")
    return binary


def start_reference(binary: str, kubeconfig: Path, workdir: Path, revision: str = "default",
                    http_port: int | None = None, mesh_networks: str = "networks: {}\n",
                    ) -> tuple[subprocess.Popen[bytes], str, str]:
    """Istio's istiod as shared/reference-istiod/README.md runs it, ambient on, once ready; its
    plaintext xDS address and its metrics' URL. `http_port`: its debug port (default: a free one);
    `mesh_networks`: its --networksConfig file's YAML."""
    (workdir / "mesh.yaml").write_text("trustDomain: cluster.local\n"
                                       "defaultConfig: {discoveryAddress: istiod.istio-system.svc:15012}\n")
    (workdir / "meshNetworks.yaml").write_text(mesh_networks)
    grpc_port, monitoring_port = free_port(), free_port()
    http_port = http_port or free_port()
    env = {**os.environ, "POD_NAMESPACE": "istio-system", "POD_NAME": "istiod-ref-0", "REVISION": revision,
           "PILOT_CERT_PROVIDER": "istiod", "CLUSTER_ID": "Kubernetes", "INJECT_ENABLED": "false",
           "VALIDATION_WEBHOOK_CONFIG_NAME": "", "JWT_POLICY": "third-party-jwt", "PILOT_ENABLE_ANALYSIS": "false",
           "PILOT_ENABLE_AMBIENT": "true"}
    secure = free_port()
    env["ISTIOD_ADDR"] = f"127.0.0.1:{secure}"
    with open(workdir / "reference.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, "discovery", f"--kubeconfig={kubeconfig}", f"--meshConfig={workdir / 'mesh.yaml'}",
             f"--networksConfig={workdir / 'meshNetworks.yaml'}", f"--grpcAddr=127.0.0.1:{grpc_port}",
             f"--secureGRPCAddr=127.0.0.1:{secure}", f"--httpAddr=127.0.0.1:{http_port}",
             f"--httpsAddr=127.0.0.1:{free_port()}", f"--monitoringAddr=127.0.0.1:{monitoring_port}",
             "--ctrlz_address=127.0.0.1", f"--ctrlz_port={free_port()}", "--domain=cluster.local",
             "--clusterID=Kubernetes"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_group(proc, grace=5)
            tail = (workdir / "reference.log").read_text(errors="replace").splitlines()[-20:]
            raise SystemExit("Istio's istiod did not become ready; its log ends:\n" + "\n".join(tail))
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/ready", timeout=2) as reply:
                if reply.status == 200:
                    return proc, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{monitoring_port}/metrics"
        time.sleep(0.3)

"""`python -m istiod.demo.sidecars` (`make demo-sidecars`, as root): two pods with Envoy sidecars.

Starts istiod on loopback with deploy/sidecars/mesh.yaml, makes pods a-1 and b-1 as network
namespaces with istio-init's capture, runs `istiod agent proxy` (and so Envoy) in each as uid 1337,
an HTTP app in b-1, then calls http://b.sidecars.svc.cluster.local:8080 from a-1 and shows what
each Envoy counted. Everything is removed when it ends (or on Ctrl-C with --keep).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from istiod.demo.pods import Netns, Node, Sidecar, missing_privileges, sweep

MESH = Path(__file__).resolve().parents[2] / "deploy" / "sidecars" / "mesh.yaml"
URL = "http://b.sidecars.svc.cluster.local:8080/hello"
HOSTS = {"b.sidecars.svc.cluster.local": "10.96.0.3", "b.sidecars": "10.96.0.3"}
TOKENS = {"a-token": "sidecars/a", "b-token": "sidecars/b"}


class Demo:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []

    def start(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("wb")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append((name, process, log))
        return process

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for _, process, log in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            log.close()


def wait(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.2)
    return result


def run(keep: bool) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="sp-demo-"))
    workdir.chmod(0o755)  # the pods' agents run as uid 1337
    (workdir / "tokens.json").write_text(json.dumps(TOKENS))
    demo = Demo(workdir)
    sweep()
    node = Node()
    try:
        ports_file = workdir / "ports.json"
        demo.start("istiod", [sys.executable, "-m", "istiod", "discovery", "--config-dir", str(MESH.parent),
                              "--grpc-addr", "127.0.0.1:0", "--secure-grpc-addr", "127.0.0.1:0",
                              "--http-addr", "127.0.0.1:0", "--monitoring-addr", "127.0.0.1:0",
                              "--ports-file", str(ports_file), "--ca-state-dir", str(workdir / "state"),
                              "--tls-extra-san", "127.0.0.1", "--ca-static-tokens", str(workdir / "tokens.json")])
        ports = json.loads(wait(lambda: ports_file.exists() and ports_file.read_text(), 30, "istiod's ports"))
        print(f"istiod: xDS and CA on 127.0.0.1:{ports['secure-grpc']}, debug on http://127.0.0.1:{ports['http']}")
        pods: dict[str, Netns] = {}
        for name, host, account, token in (("a-1", 2, "a", "a-token"), ("b-1", 3, "b", "b-token")):
            pod = pods[name] = node.add_pod(name[0], host, HOSTS)
            sidecar = Sidecar(pod, workdir / name, name, "sidecars", account, node.pod_ip(host))
            sidecar.prepare(workdir / "state" / "root-cert.pem", token)
            subprocess.run(sidecar.capture_command(), check=True, capture_output=True, timeout=30)
            demo.start(f"tunnel-{name}", sidecar.tunnel_command(f"127.0.0.1:{ports['secure-grpc']}"))
            demo.start(f"agent-{name}", sidecar.agent_command("--termination-drain-duration", "1s"))
            print(f"pod {name}: namespace {pod.name}, IP {node.pod_ip(host)}, agent and Envoy as uid 1337")
        demo.start("app-b-1", pods["b-1"].exec_args(sys.executable, "-m", "istiod.demo.apps", "http-server",
                                                    "--address", "10.44.0.3:8080", "--name", "b-1"))
        wait(lambda: '"serving"' in demo.log("app-b-1"), 30, "b-1's app to serve")
        for name, pod in pods.items():
            wait(lambda: _admin(pod, "/ready") == "LIVE", 60, f"{name}'s Envoy to be ready")
        print(f"\n$ ip netns exec {pods['a-1'].name} python -m istiod.demo.apps http-get {URL}")
        reply = wait(lambda: _call(pods["a-1"]), 30, "a reply from b-1")
        print(json.dumps(reply, indent=2))
        print(f"\na-1's Envoy: {_counters(pods['a-1'], 'outbound|8080||b.sidecars.svc.cluster.local')}")
        print(f"b-1's Envoy: {_counters(pods['b-1'], 'inbound|8080||')}")
        status = [sys.executable, "-m", "istiod", "proxy-status", "--istiod", f"http://127.0.0.1:{ports['monitoring']}"]
        print(f"\n$ istiod proxy-status\n{subprocess.run(status, capture_output=True, text=True, timeout=30).stdout}")
        if keep:
            print(f"\nRunning until Ctrl-C. Try: ip netns exec {pods['a-1'].name} curl -s {URL}")
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return 0
    except (TimeoutError, subprocess.CalledProcessError) as error:
        print(f"demo failed: {error}", file=sys.stderr)
        for name, _, _ in demo.processes:
            print(f"--- {name}:\n{demo.log(name)[-3000:]}", file=sys.stderr)
        return 1
    finally:
        demo.stop()
        node.delete()
        shutil.rmtree(workdir, ignore_errors=True)


def _admin(pod: Netns, path: str) -> str:
    return pod.run("curl", "-s", "--max-time", "2", f"http://127.0.0.1:15000{path}").stdout.strip()


def _call(pod: Netns) -> dict[str, Any] | None:
    done = pod.run(sys.executable, "-m", "istiod.demo.apps", "http-get", URL)
    reply: dict[str, Any] = json.loads(done.stdout.splitlines()[-1]) if done.stdout else {}
    return reply if reply.get("ok") else None


def _counters(pod: Netns, cluster: str) -> str:
    lines = _admin(pod, "/stats").splitlines()
    return ", ".join(line for line in lines if line.startswith(f"cluster.{cluster}.upstream_rq_total")
                     or line.startswith(f"cluster.{cluster}.upstream_cx_total"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m istiod.demo.sidecars", description=__doc__)
    parser.add_argument("--keep", action="store_true", help="keep the pods running until Ctrl-C")
    args = parser.parse_args(argv)
    reason = missing_privileges()
    if reason:
        print(f"demo-sidecars {reason}", file=sys.stderr)
        return 1
    return run(args.keep)


if __name__ == "__main__":
    sys.exit(main())

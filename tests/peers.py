"""Real processes for tests: istiod itself and the demo gRPC backends and clients.

Every wait is bounded, and every process is stopped by the fixture that started it, even on failure.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return sock.getsockname()[1]


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def eventually(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """wait_until for async tests: sleeps on the event loop, so in-process gRPC streams keep moving.

    `check` may be a plain function or return an awaitable (an async probe); its first truthy result
    is returned.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def stop_group(proc: subprocess.Popen, grace: float) -> None:  # type: ignore[type-arg]
    """SIGTERM the process group, then SIGKILL what is left after `grace` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


class Process:
    """A child process whose stdout lines are collected (JSON lines parsed) by a thread."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, name: str = "") -> None:
        self.name = name or args[0]
        self.lines: queue.Queue[Any] = queue.Queue()
        self.output: list[str] = []
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("{"):
                try:
                    self.lines.put(json.loads(line))
                except json.JSONDecodeError:
                    pass

    def next_json(self, timeout: float) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no output within {timeout}s; log:\n{self.log()}") from None

    def drain(self) -> list[dict[str, Any]]:
        items = []
        while True:
            try:
                items.append(self.lines.get_nowait())
            except queue.Empty:
                return items

    def log(self) -> str:
        return "".join(self.output[-60:])

    def text(self) -> str:
        return "".join(self.output)

    def stop(self) -> None:
        stop_group(self.proc, grace=5)


class Istiod(Process):
    def __init__(self, workdir: Path, *args: str, ready_timeout: float | None = 20, log_format: str = "kv",
                 env: dict[str, str] | None = None, open_files: int | None = None) -> None:
        """`args` name the source (`--config-dir DIR` or `--kubeconfig FILE`) and any other flags;
        `open_files`: its soft and hard limit on open files (util-linux's prlimit)."""
        ports_file = workdir / "ports.json"
        ports_file.unlink(missing_ok=True)
        self.state_dir = workdir / "state"
        limited = ["prlimit", f"--nofile={open_files}:{open_files}", "--"] if open_files else []
        super().__init__(
            [*limited, sys.executable, "-m", "istiod", "--log-format", log_format, "discovery",
             "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--monitoring-addr", "127.0.0.1:0",
             "--ports-file", str(ports_file),
             "--secure-grpc-addr", "127.0.0.1:0", "--webhook-addr", "127.0.0.1:0", "--ca-state-dir", str(self.state_dir), "--tls-extra-san", "127.0.0.1",
             "--debounce-after", "50ms", *args],
            env=env,
            name="istiod",
        )
        try:
            wait_until(lambda: ports_file.exists() and ports_file.read_text(), 20, "istiod's ports file")
            self.ports = json.loads(ports_file.read_text())
            if ready_timeout is not None:
                wait_until(lambda: self.get("/ready")[0] == 200, ready_timeout, "istiod /ready")
        except BaseException:
            self.stop()
            raise

    @property
    def xds_address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def secure_address(self) -> str:
        """xDS and the CA over TLS; istiod's certificate has 127.0.0.1 as an IP SAN in tests."""
        return f"127.0.0.1:{self.ports['secure-grpc']}"

    @property
    def root_cert(self) -> Path:
        """Where istiod publishes its root in config-dir mode (the istio-ca-root-cert stand-in)."""
        return self.state_dir / "root-cert.pem"

    def url(self, port: str = "http") -> str:
        return f"http://127.0.0.1:{self.ports[port]}"

    def get(self, path: str, port: str = "http") -> tuple[int, Any]:
        """(status, JSON or text) of a GET on the http (8080) or monitoring (15014) port; (0, None) if down."""
        try:
            with urllib.request.urlopen(f"{self.url(port)}{path}", timeout=5) as reply:
                body = reply.read().decode()
                status = reply.status
        except urllib.error.HTTPError as error:
            body, status = error.read().decode(), error.code
        except OSError:
            return 0, None
        try:
            return status, json.loads(body)
        except json.JSONDecodeError:
            return status, body


    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample on /metrics by (name as exposed, labels); counters keep Istio's bare names."""
        status, text = self.get("/metrics", port="monitoring")
        assert status == 200, text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # The parser names counter samples `<name>_total`; istiod exposes them as `<name>`.
                name = family.name if family.type == "counter" and sample.name == family.name + "_total" else sample.name
                samples[(name, frozenset(sample.labels.items()))] = sample.value
        return samples


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """One sample's value, 0 when absent (labelled series appear on first use)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def demo(*args: str, env: dict[str, str] | None = None, name: str = "") -> Process:
    return Process([sys.executable, "-m", "istiod.demo", *args], env=env, name=name)


def agent(*args: str, name: str = "agent") -> Process:
    return Process([sys.executable, "-m", "istiod", "agent", *args], name=name)


def make_plan(*args: str) -> str:
    """What `make -n ARGS` would run, as a user's shell sees it: without the variables of a make
    this test may run under (`make test` sets MAKELEVEL, and make then adds directory lines)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "-n", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
                          check=True).stdout


def istio_binary(name: str) -> str:
    """Istio's own `istioctl` or `pilot-agent`, built by e2e/cluster/build-istio.sh (`make istio-bin`)."""
    path = Path(os.environ.get(name.upper().replace("-", "_"), ROOT / ".cache" / "istio-bin" / name))
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{path} is missing; run `make istio-bin` (needs Go on PATH)")
    return str(path)


def istio_source(path: str) -> Path:
    """A file of Istio's source at the version build-istio.sh builds (the Go module cache holds it once
    the binaries are built), e.g. what Istio's proxy image copies in beside pilot-agent."""
    done = subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", "istio.io/istio"], cwd=ROOT / "e2e" / "cluster" / "istio",
                          capture_output=True, text=True, timeout=60)
    source = Path(done.stdout.strip()) / path
    if done.returncode != 0 or not source.is_file():
        raise RuntimeError(f"Istio's {path} is missing ({done.stderr.strip()}); run `make istio-bin` (needs Go on PATH)")
    return source

"""Start-up as a new user meets it: `istiod discovery` as a subprocess, its exit code and the one
stderr line that says what to change (never a traceback)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.peers import ROOT, Istiod, Process, demo, free_port, make_plan, wait_until

LOOPBACK_PORTS = ("--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--monitoring-addr", "127.0.0.1:0",
                  "--secure-grpc-addr", "127.0.0.1:0")


def discovery(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "istiod", "discovery", *LOOPBACK_PORTS, "--ca-state-dir", str(tmp_path / "state"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
    )
    print(f"$ istiod discovery ... {' '.join(args)}\nexit {result.returncode}\n{result.stderr}")
    return result


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line that says what went wrong: istiod's last, after any log lines; no traceback."""
    assert "Traceback" not in result.stderr
    return result.stderr.splitlines()[-1]


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


@pytest.mark.parametrize("flag", ["--grpc-addr", "--secure-grpc-addr", "--http-addr", "--monitoring-addr"])
def test_a_port_in_use_names_the_port_and_the_flag(flag: str, tmp_path: Path, listener: socket.socket) -> None:
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    result = discovery(tmp_path, "--config-dir", str(ROOT / "deploy/demo"), flag, address)
    assert result.returncode == 1
    assert error_line(result) == (f"istiod: cannot listen on {address} ({flag}): the port is in use;"
                                  f" choose another with {flag}")


@pytest.mark.parametrize("first_workers, second_workers", [("1", "1"), ("2", "1"), ("1", "2"), ("2", "2")])
def test_a_second_istiod_on_the_same_ports_fails_instead_of_sharing(
    tmp_path: Path, processes: list[Process], first_workers: str, second_workers: str
) -> None:
    # grpcio sets SO_REUSEPORT unless told not to: two istiods would then split 15010's clients silently.
    # Worker processes share the port with SO_REUSEPORT, but only those of one istiod.
    (tmp_path / "first").mkdir()
    first = Istiod(tmp_path / "first", "--config-dir", str(ROOT / "deploy/demo"), "--xds-workers", first_workers)
    processes.append(first)
    address = f"127.0.0.1:{first.ports['grpc']}"
    result = discovery(tmp_path, "--config-dir", str(ROOT / "deploy/demo"), "--grpc-addr", address,
                       "--xds-workers", second_workers)
    assert result.returncode == 1
    assert error_line(result) == (f"istiod: cannot listen on {address} (--grpc-addr): the port is in use;"
                                  " choose another with --grpc-addr")


def test_missing_or_wrong_files_and_directories(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    garbage = tmp_path / "kubeconfig"
    garbage.write_text("clusters: [\n")
    demo_dir = str(ROOT / "deploy/demo")
    cases = [
        (("--config-dir", str(tmp_path / "nope")), f"istiod discovery: --config-dir {tmp_path / 'nope'}: no such directory"),
        (("--config-dir", str(afile)), f"istiod discovery: --config-dir {afile}: is not a directory"),
        (("--kubeconfig", str(tmp_path / "nope")), f"istiod discovery: --kubeconfig {tmp_path / 'nope'}: no such file"),
        (("--config-dir", demo_dir, "--debug-auth-token-file", str(tmp_path / "token")),
         f"istiod discovery: --debug-auth-token-file {tmp_path / 'token'}: no such file"),
        (("--config-dir", demo_dir, "--ca-static-tokens", str(tmp_path / "tokens.json")),
         f"istiod discovery: --ca-static-tokens {tmp_path / 'tokens.json'}: no such file"),
        (("--config-dir", demo_dir, "--ca-state-dir", str(afile)), f"istiod discovery: --ca-state-dir {afile}: is not a directory"),
        (("--config-dir", demo_dir, "--ports-file", str(tmp_path / "nope/ports.json")),
         f"istiod discovery: --ports-file: the directory {tmp_path / 'nope'}: no such directory"),
        (("--config-dir", demo_dir, "--plugged-ca-dir", str(tmp_path / "cacerts")),
         f"istiod discovery: --plugged-ca-dir {tmp_path / 'cacerts'}: no such directory"),
        (("--config-dir", demo_dir, "--ca-state-dir", str(afile / "state")),
         f"istiod: cannot start the CA: [Errno 20] Not a directory: '{afile / 'state'}'"),
    ]
    for args, line in cases:
        result = discovery(tmp_path, *args)
        assert (result.returncode, error_line(result)) == (1, line)
    result = discovery(tmp_path, "--kubeconfig", str(garbage))
    assert result.returncode == 1
    assert error_line(result).startswith(f"istiod: cannot use kubeconfig {garbage}: while parsing a flow node")


def test_bad_command_lines_exit_2_with_one_line(tmp_path: Path) -> None:
    demo_dir = str(ROOT / "deploy/demo")
    cases = [
        (("--config-dir", demo_dir, "--grpc-adr", ":15010"),
         "istiod discovery: unknown flag --grpc-adr; did you mean --grpc-addr? (see istiod discovery --help)"),
        (("--config-dir", demo_dir, "--debounce-after", "100"),
         "istiod discovery: argument --debounce-after: duration '100' must be a number with a unit, like 100ms, 1m30s"
         " or 24h (see istiod discovery --help)"),
        (("--configdir", demo_dir), "istiod discovery: unknown flag --configdir; did you mean --config-dir?"
                                    " (see istiod discovery --help)"),
    ]
    for args, line in cases:
        result = discovery(tmp_path, *args)
        assert (result.returncode, result.stderr) == (2, line + "\n")


def test_bad_environment_values_name_the_variable(tmp_path: Path) -> None:
    for variable, value in (("PILOT_DEBOUNCE_AFTER", "100"), ("GRPC_ADDR", "15010"), ("PILOT_PUSH_THROTTLE", "lots")):
        result = discovery(tmp_path, "--config-dir", str(ROOT / "deploy/demo"), env={variable: value})
        assert result.returncode == 1
        assert result.stderr.startswith(f"istiod: environment variable {variable}={value!r} is not valid: ")
        assert len(result.stderr.splitlines()) == 1


def test_a_bad_discovery_selector_is_an_error(tmp_path: Path) -> None:
    result = discovery(tmp_path, "--config-dir", str(ROOT / "deploy/demo"), "--discovery-selector", "env: prod")
    assert (result.returncode, len(result.stderr.splitlines())) == (1, 1)
    assert result.stderr.startswith("istiod discovery: discovery selector 'env: prod': 'env:' is not a valid label key")


def test_kubeconfig_in_the_environment_does_not_break_the_demo(tmp_path: Path, processes: list[Process]) -> None:
    # `make run`'s command line, with a developer's KUBECONFIG (and even a pod's environment) set.
    istiod = Istiod(tmp_path, "--config-dir", "deploy/demo",
                    env={"KUBECONFIG": str(tmp_path / "kubeconfig"), "KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    processes.append(istiod)
    assert istiod.get("/debug/registryz")[1][0]["hostname"] == "echo.demo.svc.cluster.local"


def test_start_up_prints_where_it_listens_and_what_it_loaded(tmp_path: Path, processes: list[Process]) -> None:
    istiod = Istiod(tmp_path, "--config-dir", "deploy/demo")
    processes.append(istiod)
    ports = istiod.ports
    wait_until(lambda: "msg=loaded" in istiod.text(), 10, "the loaded line")
    lines = istiod.text().splitlines()
    listening = next(line for line in lines if "msg=listening" in line)
    assert listening.endswith(
        f"msg=listening xds=127.0.0.1:{ports['grpc']} xds_tls_and_ca=127.0.0.1:{ports['secure-grpc']}"
        f" debug=http://127.0.0.1:{ports['http']}/debug metrics=http://127.0.0.1:{ports['monitoring']}/metrics")
    loaded = next(line for line in lines if "msg=loaded" in line)
    assert loaded.endswith("msg=loaded source=deploy/demo CronJob=1 Job=1 Namespace=1 Node=1 PersistentVolume=1"
                           " PersistentVolumeClaim=1 Pod=3 Service=1")


def make_command(target: str) -> list[str]:
    """The command `make <target>` runs (its last line), as the README tells a user to type it."""
    return make_plan(target).strip().splitlines()[-1].split()


def test_the_readme_edit_and_watch_works_as_written(tmp_path: Path, processes: list[Process]) -> None:
    # The README's demo on a copy of deploy/demo whose pods are at addresses of this test's own.
    mesh = tmp_path / "demo"
    shutil.copytree(ROOT / "deploy/demo", mesh)
    backends = {f"echo-{n}": (f"127.0.0.{130 + n}", free_port(f"127.0.0.{130 + n}")) for n in (1, 2, 3)}
    text = (mesh / "mesh.yaml").read_text()
    for old_ip, (ip, port) in zip(("127.0.0.10", "127.0.0.11"), (backends["echo-1"], backends["echo-2"]), strict=True):
        head, _, tail = text.partition(f"podIP: {old_ip}")
        # Each pod's containerPort is the last one before its podIP.
        before, _, rest = head.rpartition("containerPort: 7070")
        text = f"{before}containerPort: {port}{rest}podIP: {ip}{tail}"
    (mesh / "mesh.yaml").write_text(text)
    istiod = Istiod(tmp_path, "--config-dir", str(mesh))
    processes.append(istiod)
    for name, (ip, port) in backends.items():
        processes.append(demo("server", "--address", f"{ip}:{port}", "--name", name, name=name))

    command = make_command("demo-client")
    assert command[:4] == [".venv/bin/python", "-m", "istiod.demo", "client"] and "127.0.0.1:15010" in command
    client = Process([sys.executable, *(a.replace("127.0.0.1:15010", istiod.xds_address) for a in command[1:])],
                     name="client")
    processes.append(client)

    def replies(names: set[str]) -> Callable[[], bool]:
        seen: set[str] = set()

        def check() -> bool:
            seen.update(line["reply"].split()[0] for line in client.drain() if line.get("ok"))
            return names <= seen

        return check

    wait_until(replies({"echo-1", "echo-2"}), 30, "replies from both backends")
    ip2, port2 = backends["echo-2"]
    ip3, port3 = backends["echo-3"]
    # The README's edit: move the second pod to where echo-3 listens.
    (mesh / "mesh.yaml").write_text(text.replace(f"containerPort: {port2}", f"containerPort: {port3}")
                                    .replace(f"podIP: {ip2}", f"podIP: {ip3}"))
    wait_until(replies({"echo-3"}), 30, "the client to follow the edit to echo-3")
    client.drain()
    wait_until(replies({"echo-1", "echo-3"}), 10, "replies after the edit")
    assert client.proc.poll() is None, "the client stopped calling"


def test_the_readme_agent_walkthrough_gets_a_certificate_from_make_run(tmp_path: Path, processes: list[Process]) -> None:
    """The README's `istiod agent` command against `make run`'s istiod: its token is one the demo CA
    takes, and the certificate it dials names 127.0.0.1 (Envoy itself is tests/test_agent_proxy.py's)."""
    run = make_command("run")
    assert run[:2] == [".venv/bin/istiod", "discovery"]
    assert "--tls-extra-san 127.0.0.1" in " ".join(run)
    readme = (ROOT / "README.md").read_text()
    start = readme.index(".venv/bin/istiod agent --ca-addr")
    command = readme[start:readme.index("\n```", start)].replace("\\\n", " ").split()
    agent_args = command[1:command.index("proxy")]  # the certificate half: `proxy` would start Envoy
    istiod = Istiod(tmp_path, *run[2:])
    processes.append(istiod)
    replaced = {"127.0.0.1:15012": istiod.secure_address, "state/root-cert.pem": str(istiod.root_cert),
                "pod/certs": str(tmp_path / "certs")}
    agent = Process([sys.executable, "-m", "istiod", *(replaced.get(arg, arg) for arg in agent_args)], name="agent")
    processes.append(agent)
    wait_until(lambda: "wrote certificate for spiffe://cluster.local/ns/app/sa/web" in agent.text()
               or agent.proc.poll() is not None, 30, "the agent's certificate")
    assert (tmp_path / "certs" / "cert-chain.pem").exists(), agent.text()


def test_xds_connections_are_recycled_after_the_max_connection_age(tmp_path: Path, processes: list[Process]) -> None:
    # pilot-discovery's --keepaliveMaxServerConnectionAge: GOAWAY after the age, streams closed after
    # istiod's 10s grace, and a real grpcio client reconnects (to any replica, in a cluster).
    istiod = Istiod(tmp_path, "--config-dir", "deploy/demo", "--keepaliveMaxServerConnectionAge", "1s")
    processes.append(istiod)
    client = demo("client", "xds:///echo.demo.svc.cluster.local:7070", "--xds", istiod.xds_address, "--count", "0",
                  "--namespace", "demo", name="client")
    processes.append(client)

    def connection_ids() -> set[str]:
        return {s["connection_id"] for s in istiod.get("/debug/syncz")[1] if ".demo~" in s["proxy"]}

    first = wait_until(connection_ids, 20, "the client's ADS connection")
    started = time.monotonic()
    wait_until(lambda: connection_ids() - first, 30, "the client to come back on a new connection")
    print(f"new connection after {time.monotonic() - started:.1f}s (age 1s + grace 10s)")

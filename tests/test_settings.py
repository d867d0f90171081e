"""Flags and environment as a new user meets them: Go durations, label selectors, pilot-discovery's
spellings, KUBECONFIG, and the help text (in-process; tests/test_startup.py runs the binary)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from istiod.cli import build_parser
from istiod.durations import parse_duration
from istiod.settings import Settings, settings_from_args
from istiod.sources.namespaces import parse_selector
from tests.peers import ROOT, make_plan

DURATION_FLAGS = ("--debounce-after", "--debounce-max", "--poll-interval", "--watch-timeout", "--leader-lease-duration",
                  "--leader-renew-deadline", "--leader-retry-period", "--workload-cert-ttl", "--max-workload-cert-ttl",
                  "--keepalive-max-server-connection-age")


def settings(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["discovery", *argv]))


@given(st.integers(0, 1000), st.integers(0, 59), st.integers(0, 59), st.integers(0, 999))
def test_go_durations(hours: int, minutes: int, seconds: int, millis: int) -> None:
    text = f"{hours}h{minutes}m{seconds}s{millis}ms"
    assert parse_duration(text) == pytest.approx(hours * 3600 + minutes * 60 + seconds + millis / 1000)


@pytest.mark.parametrize("text, seconds", [("1m30s", 90), ("100ms", 0.1), ("1.5h", 5400), ("0", 0), ("2562047h", 2562047 * 3600),
                                           ("1us", 1e-6), ("300µs", 3e-4)])
def test_go_duration_examples(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text, reason", [
    ("100", "must be a number with a unit"), ("nan", "must be a number with a unit"), ("inf", "must be a number"),
    ("-1s", "must not be negative"), ("1d", "must be a number with a unit"), ("1h-1s", "must be a number with a unit"),
    ("", "must be a number with a unit"), ("2562048h", "longer than Go's longest"),
])
def test_durations_go_refuses(text: str, reason: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=reason):
        parse_duration(text)


@pytest.mark.parametrize("flag", DURATION_FLAGS)
def test_every_duration_flag_takes_go_durations_only(flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["discovery", "--config-dir", str(tmp_path), flag, "1m30s"])
    assert getattr(args, flag.removeprefix("--").replace("-", "_")) == 90
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["discovery", "--config-dir", str(tmp_path), flag, "100"])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(f"istiod discovery: argument {flag}") and "duration '100' must be a number with a unit" in error


@pytest.mark.parametrize("variable, value", [
    ("PILOT_DEBOUNCE_AFTER", "100"), ("PILOT_DEBOUNCE_MAX", "-1s"), ("DEFAULT_WORKLOAD_CERT_TTL", "nan"),
    ("MAX_WORKLOAD_CERT_TTL", "90d"), ("SECRET_TTL", "24"), ("GRPC_ADDR", "15010"), ("HTTP_ADDR", "x:y"),
    ("PILOT_PUSH_THROTTLE", "0"), ("PILOT_ENABLE_EDS_DEBOUNCE", "maybe"),


    ("PILOT_PUSH_THROTTLE", "0"), ("PILOT_MAX_REQUESTS_PER_SECOND", "-1"), ("PILOT_MAX_REQUESTS_PER_SECOND", "fast"),
    ("CA_TRUSTED_NODE_ACCOUNTS", "istio-system"), ("CA_TRUSTED_NODE_ACCOUNTS", "istio-system/Ztunnel"),
])
def test_bad_environment_values_name_the_variable(variable: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit:
        build_parser()
    assert str(exit.value.code).startswith(f"istiod: environment variable {variable}={value!r} is not valid: ")


def test_debounce_defaults_and_variables_are_istiods(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    defaults = settings("--config-dir", str(tmp_path))
    assert (defaults.debounce_after, defaults.debounce_max, defaults.eds_debounce) == (0.1, 10.0, True)
    monkeypatch.setenv("PILOT_DEBOUNCE_MAX", "2s")
    monkeypatch.setenv("PILOT_ENABLE_EDS_DEBOUNCE", "false")
    from_env = settings("--config-dir", str(tmp_path))
    assert (from_env.debounce_max, from_env.eds_debounce) == (2.0, False)
    assert settings("--config-dir", str(tmp_path), "--enable-eds-debounce", "1").eds_debounce


def test_trusted_node_accounts_from_the_flag_or_istiods_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert settings("--config-dir", str(tmp_path)).ca.trusted_node_accounts == (("istio-system", "ztunnel"),)
    monkeypatch.setenv("CA_TRUSTED_NODE_ACCOUNTS", "mesh/ztunnel, kube-system/node-agent")
    assert settings("--config-dir", str(tmp_path)).ca.trusted_node_accounts == (
        ("mesh", "ztunnel"), ("kube-system", "node-agent"))
    assert settings("--config-dir", str(tmp_path), "--ca-trusted-node-accounts", "").ca.trusted_node_accounts == ()


def test_request_rate_from_the_flag_or_istiods_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert settings("--config-dir", str(tmp_path)).max_requests_per_second == 1000
    monkeypatch.setenv("PILOT_MAX_REQUESTS_PER_SECOND", "25")
    assert settings("--config-dir", str(tmp_path)).max_requests_per_second == 25
    assert settings("--config-dir", str(tmp_path), "--max-requests-per-second", "0").max_requests_per_second == 0


def test_environment_durations_use_the_same_grammar(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PILOT_DEBOUNCE_AFTER", "1m30s")
    assert settings("--config-dir", str(tmp_path)).debounce_after == 90


@pytest.mark.parametrize("text, labels, selected", [
    ("env=prod", {"env": "prod"}, True),
    ("env==prod", {"env": "prod"}, True),
    ("env!=prod", {"env": "dev"}, True),
    ("env!=prod", {}, True),  # as in Kubernetes: a missing label is "not prod"
    ("env in (prod, staging)", {"env": "staging"}, True),
    ("env in (prod,staging)", {"env": "dev"}, False),
    ("env notin (prod)", {"env": "dev"}, True),
    ("env notin (prod)", {}, True),
    ("env notin (prod)", {"env": "prod"}, False),
    ("!legacy", {"legacy": ""}, False),
    ("istio.io/rev", {"istio.io/rev": "canary"}, True),
    ("env=prod,team,!legacy", {"env": "prod", "team": "a"}, True),
    ("env=prod,team,!legacy", {"env": "prod", "team": "a", "legacy": "1"}, False),
    ("tier>2", {"tier": "3"}, True),
    ("tier<2", {"tier": "x"}, False),
    ("", {"anything": "x"}, True),  # an empty selector selects everything, as Kubernetes'
])
def test_kubernetes_label_selector_grammar(text: str, labels: dict[str, str], selected: bool) -> None:
    assert parse_selector(text).matches(labels) is selected


@pytest.mark.parametrize("text, reason", [
    ("env: prod", "'env:' is not a valid label key"),
    ("env=prod team=a", "expected ','"),
    ("env=prod,,x", "empty term"),
    ("env in prod", "need a list in parentheses"),
    ("env in ()", "is empty"),
    ("env in (a,b", "not closed"),
    ("env=a=b", "expected ','"),
    ("Env/x=1", "not a valid label key"),
    ("env=" + "v" * 64, "not a valid label value"),
    ("env~prod", "not a valid label key"),
    ("env is prod", "unknown operator .is."),
    ("tier>high", "needs an integer"),
])
def test_selectors_that_are_not_kubernetes_grammar_are_errors(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_selector(text)


def test_pilot_discovery_spellings_are_aliases(tmp_path: Path) -> None:
    mesh = tmp_path / "mesh"
    mesh.write_text("{}\n")
    result = settings("--configDir", str(tmp_path), "--grpcAddr", "127.0.0.1:1", "--httpAddr", ":2",
                      "--monitoringAddr", "127.0.0.2:3", "--meshConfig", str(mesh), "--domain", "example.org",
                      "--keepaliveMaxServerConnectionAge", "5m", "--shutdownDuration", "20s")
    assert result.shutdown_duration == 20 and settings("--config-dir", str(tmp_path)).shutdown_duration == 10
    assert (result.config_dir, str(result.grpc_addr), str(result.http_addr), str(result.monitoring_addr)) == (
        tmp_path, "127.0.0.1:1", ":2", "127.0.0.2:3")
    assert (result.mesh_config, result.domain, result.keepalive.max_connection_age) == (mesh, "example.org", 300)


def test_an_explicit_config_dir_wins_over_kubeconfig_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    result = settings("--config-dir", str(tmp_path))
    assert (result.config_dir, result.kubeconfig, result.in_cluster) == (tmp_path, None, False)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\n")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert settings().kubeconfig == kubeconfig  # without --config-dir, KUBECONFIG still names the cluster


def test_help_states_bind_addresses_and_the_ca_state_location() -> None:
    help = subprocess.run([sys.executable, "-m", "istiod", "discovery", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=30).stdout
    flat = " ".join(help.split())
    for flag, port in (("--grpc-addr", 15010), ("--secure-grpc-addr", 15012), ("--http-addr", 8080),
                       ("--monitoring-addr", 15014)):
        assert f"(default :{port}, every interface)" in flat, flag
    assert "(default ./state, under the directory istiod starts in)" in flat
    readme = " ".join((ROOT / "README.md").read_text().split())
    for port in (15010, 15012, 8080, 15014):
        assert f"`:{port}` (every interface)" in readme
    assert "`./state` under the directory istiod starts in" in readme


def test_make_run_installs_without_test_extras_and_shows_progress(tmp_path: Path) -> None:
    plan = make_plan("run", f"VENV={tmp_path / 'venv'}")
    installs = [line for line in plan.splitlines() if " install " in line]
    print(plan)
    assert installs and all("[test]" not in line and "--quiet" not in line and " -q" not in line for line in installs)
    assert "--config-dir deploy/demo" in plan.splitlines()[-1]

"""`istiod agent iptables`: istio-init's rules as text, and applied in a network namespace."""

from __future__ import annotations

import subprocess
import sys

import pytest

from istiod.agent.iptables import CaptureConfig, render, without_capture
from tests.peers import ROOT
from tests.pods import netns, requires_root

# What istio-iptables writes for Istio's injected istio-init (-p 15001 -z 15006 -u 1337 -m REDIRECT
# -i '*' -x "" -b '*' -d 15090,15021,15020), in its order.
ISTIO_INIT_RULES = """\
*nat
:ISTIO_INBOUND - [0:0]
:ISTIO_REDIRECT - [0:0]
:ISTIO_IN_REDIRECT - [0:0]
:ISTIO_OUTPUT - [0:0]
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15090 -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15020 -j RETURN
-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
-A OUTPUT -p tcp -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -s 127.0.0.6/32 -o lo -j RETURN
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
COMMIT
"""


def iptables_cli(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "istiod", "agent", "iptables", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)


def test_defaults_are_istio_inits_rules() -> None:
    assert render(CaptureConfig()) == ISTIO_INIT_RULES


def test_dry_run_prints_the_rules_and_changes_nothing() -> None:
    result = iptables_cli("--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ISTIO_INIT_RULES


def test_flags_select_ports_ranges_and_owners() -> None:
    result = iptables_cli("--dry-run", "-p", "16001", "-z", "16006", "-u", "1337,1338", "-g", "999",
                          "-i", "10.96.0.0/12,10.44.0.7", "-x", "10.96.0.10/32", "-b", "8080,9090", "-o", "25")
    assert result.returncode == 0, result.stderr
    rules = result.stdout.splitlines()
    assert "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 16001" in rules
    assert "-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 16006" in rules
    # -b lists the captured inbound ports; -d then does not apply.
    assert [r for r in rules if r.startswith("-A ISTIO_INBOUND")] == [
        "-A ISTIO_INBOUND -p tcp --dport 8080 -j ISTIO_IN_REDIRECT",
        "-A ISTIO_INBOUND -p tcp --dport 9090 -j ISTIO_IN_REDIRECT",
    ]
    assert sum("--uid-owner 1337 " in r for r in rules) == 3
    assert sum("--uid-owner 1338 " in r for r in rules) == 3
    assert sum("--gid-owner 999 " in r for r in rules) == 3
    output = [r for r in rules if r.startswith("-A ISTIO_OUTPUT")]
    assert output[0] == "-A ISTIO_OUTPUT -p tcp --dport 25 -j RETURN"
    assert output[-3:] == [
        "-A ISTIO_OUTPUT -d 10.96.0.10/32 -j RETURN",
        "-A ISTIO_OUTPUT -d 10.96.0.0/12 -j ISTIO_REDIRECT",
        "-A ISTIO_OUTPUT -d 10.44.0.7/32 -j ISTIO_REDIRECT",
    ]


def test_empty_inbound_ports_capture_outbound_only() -> None:
    rules = render(CaptureConfig(include_inbound_ports=()))
    assert "PREROUTING" not in rules and "ISTIO_INBOUND -" not in rules.replace(":ISTIO_INBOUND - [0:0]", "")
    assert "-A OUTPUT -p tcp -j ISTIO_OUTPUT" in rules


@pytest.mark.parametrize(("args", "message"), [
    (("-m", "TPROXY"), "-m TPROXY: only REDIRECT is implemented"),
    (("-i", "10.0.0.0/33"), "-i: not a CIDR: '10.0.0.0/33'"),
    (("-x", "fd00::/8"), "-x: fd00::/8: only IPv4 capture is implemented"),
    (("-d", "15020,http"), "-d: not a port: 'http'"),
    (("-u", "envoy"), "-u: not a list of numeric ids: 'envoy'"),
])
def test_bad_flags_are_one_line_errors(args: tuple[str, ...], message: str) -> None:
    result = iptables_cli("--dry-run", *args)
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_clean_keeps_rules_that_are_not_istios() -> None:
    saved = ("*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:ISTIO_OUTPUT - [0:0]\n"
             "-A PREROUTING -p tcp -j ISTIO_INBOUND\n-A OUTPUT -p udp --dport 53 -j DNAT --to-destination 10.0.0.1\n"
             "-A ISTIO_OUTPUT -j ISTIO_REDIRECT\nCOMMIT\n")
    assert without_capture(saved) == ("*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
                                      "-A OUTPUT -p udp --dport 53 -j DNAT --to-destination 10.0.0.1\nCOMMIT\n")


@requires_root
def test_applied_in_a_network_namespace_and_read_back() -> None:
    with netns("iptables") as ns:
        result = iptables_cli(prefix=tuple(ns.exec_args()))
        assert result.returncode == 0, result.stderr
        assert "installed the traffic capture" in result.stderr
        # Applying twice replaces the capture rather than doubling the jumps.
        assert iptables_cli(prefix=tuple(ns.exec_args())).returncode == 0
        saved = ns.run("iptables-save", "-t", "nat").stdout
        print(saved)
        expected = [line.replace(" -p tcp --dport", " -p tcp -m tcp --dport").replace(" -p tcp ! --dport", " -p tcp -m tcp ! --dport")
                    for line in ISTIO_INIT_RULES.splitlines() if line.startswith("-A")]
        applied = [line for line in saved.splitlines() if line.startswith("-A")]
        assert sorted(applied) == sorted(expected)
        # iptables-save groups by chain; within a chain the order is what matters.
        for chain in ("ISTIO_INBOUND", "ISTIO_OUTPUT"):
            assert [r for r in applied if r.startswith(f"-A {chain} ")] == [r for r in expected if r.startswith(f"-A {chain} ")]

        result = iptables_cli("--clean", prefix=tuple(ns.exec_args()))
        assert result.returncode == 0, result.stderr
        assert "ISTIO" not in ns.run("iptables-save", "-t", "nat").stdout

"""In-pod traffic redirection to ztunnel (istio-cni's ambient "in-pod" mode).

The rules are those of ztunnel's `scripts/ztunnel-redirect-inpod.sh` and Istio's
`cni/pkg/iptables` in-pod mode, installed inside the pod's network namespace: outbound TCP goes to
ztunnel's 15001, inbound TCP (except HBONE on 15008) to 15006, DNS to 15053 when DNS capture is on;
ztunnel's own sockets carry the mark 0x539 (1337) and are never captured; inbound connections are
connmarked 0x111 so their replies find their way back through the policy route in table 100.
Kubelet's probes arrive SNATed from 169.254.7.127 and are let through. Each pod's rules are
applied atomically with iptables-restore through nsenter, and removed the way istio-clean-iptables
removes istio-init's (shared with istiod.agent.iptables).
"""

from __future__ import annotations

import logging

from istiod.agent.iptables import INBOUND_TUNNEL_PORT, clean, run_command

log = logging.getLogger(__name__)

OUTBOUND_PORT = 15001
INBOUND_PORT = 15006
DNS_PORT = 15053
ZTUNNEL_MARK = "0x539/0xfff"  # ztunnel marks its own sockets 1337: they pass untouched
CONNMARK = "0x111/0xfff"  # inbound connections, so their replies are routed locally
PROBE_SOURCE = "169.254.7.127/32"  # kubelet probes, SNATed to this address by istio-cni's node rules
ROUTE_TABLE = "100"
RULE_PRIORITY = "32764"
TABLES = ("mangle", "nat")
_LOCALHOST = "127.0.0.1/32"


def render(dns_capture: bool) -> str:
    """The iptables-restore input (mangle and nat), rule for rule as ztunnel's script writes it."""
    mangle = [
        ":ISTIO_OUTPUT - [0:0]",
        ":ISTIO_PRERT - [0:0]",
        "-A PREROUTING -j ISTIO_PRERT",
        "-A OUTPUT -j ISTIO_OUTPUT",
        f"-A ISTIO_OUTPUT -m connmark --mark {CONNMARK} -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
        f"-A ISTIO_PRERT -m mark --mark {ZTUNNEL_MARK} -j CONNMARK --set-xmark {CONNMARK}",
    ]
    nat = [
        ":ISTIO_OUTPUT - [0:0]",
        ":ISTIO_PRERT - [0:0]",
        "-A OUTPUT -j ISTIO_OUTPUT",
        "-A PREROUTING -j ISTIO_PRERT",
        f"-A ISTIO_OUTPUT -d {PROBE_SOURCE} -p tcp -m tcp -j ACCEPT",
    ]
    if dns_capture:
        nat += [
            f"-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark {ZTUNNEL_MARK} -m udp --dport 53 -j REDIRECT --to-ports {DNS_PORT}",
            f"-A ISTIO_OUTPUT ! -d {_LOCALHOST} -p tcp -m tcp --dport 53 -m mark ! --mark {ZTUNNEL_MARK} "
            f"-j REDIRECT --to-ports {DNS_PORT}",
        ]
    nat += [
        f"-A ISTIO_OUTPUT -p tcp -m mark --mark {CONNMARK} -j ACCEPT",
        f"-A ISTIO_OUTPUT ! -d {_LOCALHOST} -o lo -j ACCEPT",
        f"-A ISTIO_OUTPUT ! -d {_LOCALHOST} -p tcp -m mark ! --mark {ZTUNNEL_MARK} -j REDIRECT --to-ports {OUTBOUND_PORT}",
        f"-A ISTIO_PRERT -s {PROBE_SOURCE} -p tcp -m tcp -j ACCEPT",
        f"-A ISTIO_PRERT ! -d {_LOCALHOST} -p tcp ! --dport {INBOUND_TUNNEL_PORT} -m mark ! --mark {ZTUNNEL_MARK} "
        f"-j REDIRECT --to-ports {INBOUND_PORT}",
    ]
    return "".join(f"*{name}\n" + "\n".join(rules) + "\nCOMMIT\n" for name, rules in (("mangle", mangle), ("nat", nat)))


def _enter(netns: str) -> tuple[str, ...]:
    return ("nsenter", f"--net={netns}")


def install(netns: str, dns_capture: bool) -> None:
    """Capture the pod's traffic (replacing earlier rules), with the local route replies need."""
    enter = _enter(netns)
    clean(TABLES, enter)
    run_command([*enter, "iptables-restore", "-w", "10", "--noflush"], render(dns_capture))
    _ip(enter, "route", "replace", "local", "0.0.0.0/0", "dev", "lo", "table", ROUTE_TABLE)
    if f"lookup {ROUTE_TABLE}" not in run_command([*enter, "ip", "-4", "rule", "show", "priority", RULE_PRIORITY], None):
        _ip(enter, "rule", "add", "fwmark", CONNMARK, "pref", RULE_PRIORITY, "lookup", ROUTE_TABLE)


def remove(netns: str) -> bool:
    """Take the capture out of the pod's namespace; True if there was any."""
    enter = _enter(netns)
    found = clean(TABLES, enter)
    if f"lookup {ROUTE_TABLE}" in run_command([*enter, "ip", "-4", "rule", "show", "priority", RULE_PRIORITY], None):
        _ip(enter, "rule", "del", "pref", RULE_PRIORITY)
        found = True
    if run_command([*enter, "ip", "-4", "route", "show", "table", ROUTE_TABLE], None).strip():
        _ip(enter, "route", "flush", "table", ROUTE_TABLE)
    return found


def installed(netns: str) -> bool:
    """Whether the pod's namespace has Istio's chains (what a restarted agent must clean up)."""
    enter = _enter(netns)
    return any("ISTIO_" in run_command([*enter, "iptables-save", "-t", table], None) for table in TABLES)


def _ip(enter: tuple[str, ...], *args: str) -> None:
    run_command([*enter, "ip", *args], None)


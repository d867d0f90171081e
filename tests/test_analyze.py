"""`istiod analyze`: istioctl analyze's messages, checked against Istio's istioctl on the same files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from istiod.cli import main
from istiod.model.config.analysis import KUBE_KINDS, Objects, Resource, analyze
from tests.peers import istio_binary

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "analyze"
PROBLEMS = [
    'Error [IST0101] (VirtualService demo/reviews {f}:12) Referenced gateway not found: "missing-gw"',
    'Error [IST0101] (VirtualService demo/reviews {f}:15) Referenced host+subset in destinationrule not found: '
    '"reviews+v3"',
    "Error [IST0106] (AuthorizationPolicy demo/bad {f}:37) Schema validation error: spec.rules: DENY action without "
    "`rules` is meaningless as it will never be triggered, add an empty rule `{{}}` if you want it be triggered for "
    "every request",
    "Warning [IST0132] (VirtualService demo/reviews {f}:12) one or more host [reviews] defined in VirtualService "
    "demo/reviews not found in Gateway demo/missing-gw.",
]


def _messages(output: str) -> set[tuple[str, ...]]:
    return {tuple(sorted(m.items())) for m in json.loads(output)}


def _istioctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([istio_binary("istioctl"), "analyze", "--use-kube=false", *args],
                          capture_output=True, text=True, timeout=120)


def test_same_messages_as_istioctl(capsys: pytest.CaptureFixture[str]) -> None:
    # Every field of -o json, the file:line of the field at fault included.
    istioctl = _istioctl("-A", "-o", "json", str(FIXTURE))
    assert istioctl.returncode == 0, istioctl.stderr  # the json format never fails
    expected = _messages(istioctl.stdout)
    assert main(["analyze", "-A", "-o", "json", str(FIXTURE)]) == 0
    assert _messages(capsys.readouterr().out) == expected
    # The fixture exercises every offline analyzer we match.
    assert {dict(m)["code"] for m in expected} == {"IST0002", "IST0101", "IST0109", "IST0128", "IST0129", "IST0130", "IST0131",
                                               "IST0132", "IST0133", "IST0134", "IST0138", "IST0151", "IST0152",
                                               "IST0153", "IST0154", "IST0155", "IST0177"}


def test_a_line_per_message_and_istioctl_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    path = DATA / "istio" / "analyze.yaml"
    assert main(["analyze", "-A", str(path)]) == 79
    out = capsys.readouterr()
    assert out.out.splitlines() == [p.format(f=path) for p in PROBLEMS]
    assert "Analyzers found issues when analyzing all namespaces." in out.err
    # Where istiod's validation and Istio's agree on the problem, the lines are istioctl's but for its text.
    istioctl = _istioctl("-A", str(path))
    assert istioctl.returncode == 79
    assert [line for line in istioctl.stdout.splitlines() if "IST0106" not in line] == \
        [line for line in out.out.splitlines() if "IST0106" not in line]


def test_the_same_output_as_istioctl(capsys: pytest.CaptureFixture[str]) -> None:
    istioctl = _istioctl("-A", str(FIXTURE))
    assert main(["analyze", "-A", str(FIXTURE)]) == istioctl.returncode == 79
    out = capsys.readouterr()
    assert (out.out, out.err) == (istioctl.stdout, istioctl.stderr)


def test_only_the_selected_namespace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Only warnings: exit 0, as istioctl's failure threshold is Error.
    (tmp_path / "vs.yaml").write_text("""apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: r, namespace: demo}
spec:
  hosts: [reviews]
  http: [{route: [{destination: {host: a}}]}, {route: [{destination: {host: b}}]}]
""")
    assert main(["analyze", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "\n"
    assert main(["analyze", "-n", "demo", str(tmp_path)]) == 0
    assert capsys.readouterr().out == (f"Warning [IST0130] (VirtualService demo/r {tmp_path}/vs.yaml:1) VirtualService "
                                       "rule #1 not used (only the last rule can have no matches).\n")


def test_a_wrongly_typed_field_is_a_parse_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # istioctl leaves an object out when it does not parse, says so and exits 65 if nothing else is wrong.
    (tmp_path / "vs.yaml").write_text("""apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: t, namespace: default}
spec: {hosts: [r], http: [{timeout: 5, route: [{destination: {host: r}}]}]}
""")
    assert main(["analyze", str(tmp_path)]) == 65 == _istioctl(str(tmp_path)).returncode
    out = capsys.readouterr()
    assert out.out == "\n"
    assert "vs.yaml:1: VirtualService default/t spec.http[0]: timeout: expected str, got int" in out.err
    assert "(but 1 file could not be parsed)" in out.err


def test_no_conflict_for_two_destination_rules_of_one_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Istio merges them: no message (IST0173 is a subset that selects no pod, with a cluster only).
    (tmp_path / "dr.yaml").write_text("""apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: a}
spec: {host: reviews, subsets: [{name: v1, labels: {version: v1}}]}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: b}
spec: {host: reviews.default.svc.cluster.local}
""")
    istioctl = _istioctl(str(tmp_path / "dr.yaml"))
    assert main(["analyze", str(tmp_path / "dr.yaml")]) == 0 == istioctl.returncode
    out = capsys.readouterr()
    assert (out.out, out.err) == (istioctl.stdout, istioctl.stderr) == (
        "\n", f"\u2714 No validation issues found when analyzing {tmp_path / 'dr.yaml'}.\n")


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze"]) == 64
    assert main(["analyze", str(tmp_path / "missing.yaml")]) == 64
    assert "missing.yaml: no such file or directory" in capsys.readouterr().err


HOSTILE = """apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: a, namespace: default}
spec: {hosts: [], gateways: 5, http: 7}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: b, namespace: default}
spec: 5
---
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: c, namespace: default}
spec: {selector: [x], servers: {port: 1}}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: []
---
- just a list
---
kind: Sidecar
metadata: {name: d, namespace: default}
spec: {workloadSelector: {labels: {app: [1]}}}
---
apiVersion: v1
kind: List
items: [5, {kind: ServiceEntry, metadata: {name: e, namespace: default}, spec: {hosts: [a.com], ports: "x"}}]
"""


def test_hostile_files_are_errors_not_crashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.yaml").write_text(HOSTILE)
    (tmp_path / "broken.yaml").write_text("a: [b\n")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00")
    assert main(["analyze", "-A", str(tmp_path)]) in (65, 79)
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert "broken.yaml" in out.err and "binary.yaml" in out.err


def test_annotation_values_parse_as_gos() -> None:
    # e2e/test_analyze.py compares the annotation analyzer with istioctl's on a cluster; these are the
    # edges of Go's strconv that fixture does not reach.
    def texts(annotations: dict[str, str]) -> list[str]:
        pod = Resource("Pod", "demo", "p", {"metadata": {"annotations": annotations}})
        return [m.text for m in analyze(Objects([pod], KUBE_KINDS)) if m.code == "IST0125"]

    assert texts({"readiness.status.sidecar.istio.io/periodSeconds": "4294967295",
                  "traffic.sidecar.istio.io/excludeOutboundPorts": " 80 , 443 ",
                  "prometheus.istio.io/merge-metrics": "T"}) == []
    assert texts({"readiness.status.sidecar.istio.io/periodSeconds": "4294967296"}) == [
        'Invalid annotation readiness.status.sidecar.istio.io/periodSeconds: '
        'strconv.ParseUint: parsing "4294967296": value out of range']
    assert texts({"readiness.status.sidecar.istio.io/periodSeconds": "\u0661"}) == [
        'Invalid annotation readiness.status.sidecar.istio.io/periodSeconds: '
        'strconv.ParseUint: parsing "\u0661": invalid syntax']

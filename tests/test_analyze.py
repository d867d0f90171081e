"""`istiod analyze`: validation plus istioctl analyze's cross-object checks, a line per finding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from istiod.cli import main

DATA = Path(__file__).parent / "data" / "istio"
PROBLEMS = [
    "Error [IST0106] (AuthorizationPolicy demo/bad) Schema validation error: spec.rules: DENY action without `rules` "
    "is meaningless as it will never be triggered, add an empty rule `{}` if you want it be triggered for every request",
    "Error [IST0173] (DestinationRule demo/reviews) DestinationRules demo/reviews, demo/reviews-2 have the same host "
    "reviews.demo.svc.cluster.local.",
    "Error [IST0173] (DestinationRule demo/reviews-2) DestinationRules demo/reviews, demo/reviews-2 have the same host "
    "reviews.demo.svc.cluster.local.",
    'Error [IST0101] (Gateway demo/ingress) Referenced selector not found: "istio=ingressgateway"',
    'Error [IST0101] (VirtualService demo/reviews) Referenced gateway not found: "demo/missing-gw"',
    'Error [IST0101] (VirtualService demo/reviews) Referenced host not found: "ratings.demo.svc.cluster.local"',
    "Error [IST0101] (VirtualService demo/reviews) Referenced host+subset in destinationrule not found: "
    '"reviews.demo.svc.cluster.local+v3"',
]
CLEAN = """apiVersion: v1
kind: Service
metadata: {name: echo, namespace: demo}
spec: {ports: [{port: 7070, name: grpc}]}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: echo, namespace: demo}
spec: {hosts: [echo], http: [{route: [{destination: {host: echo, subset: v1}}]}]}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: echo, namespace: istio-system}
spec: {host: echo.demo.svc.cluster.local, subsets: [{name: v1, labels: {version: v1}}]}
"""


def test_a_line_per_finding_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(DATA / "analyze.yaml")]) == 1
    assert capsys.readouterr().out.splitlines() == PROBLEMS


def test_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "-o", "json", str(DATA / "analyze.yaml")]) == 1
    found = json.loads(capsys.readouterr().out)
    assert found[3] == {"code": "IST0101", "level": "Error", "origin": "Gateway demo/ingress",
                        "message": 'Referenced selector not found: "istio=ingressgateway"'}


def test_clean_config_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The subset comes from the root namespace's DestinationRule, found by istiod's lookup order.
    (tmp_path / "clean.yaml").write_text(CLEAN)
    assert main(["analyze", str(tmp_path)]) == 0
    assert "No validation issues found" in capsys.readouterr().out
    (tmp_path / "mesh.yaml").write_text("rootNamespace: elsewhere\n")
    assert main(["analyze", "--mesh-config", str(tmp_path / "mesh.yaml"), str(tmp_path / "clean.yaml")]) == 1


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze"]) == 2
    assert main(["analyze", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such file or directory" in capsys.readouterr().err

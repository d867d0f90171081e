"""`istiod manifest generate [-f iop.yaml] [--set path=value]`: flags and the run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from istiod.operator.manifest import DEFAULT_CHARTS, RenderError, default_helm, render
from istiod.operator.spec import SpecError, to_install, with_sets


def add_manifest_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", type=Path, help="an IstioOperator YAML file (default: the default profile)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="PATH=VALUE",
                        help="override a field of the spec, e.g. components.pilot.k8s.replicaCount=3 (repeatable)")
    parser.add_argument("--charts", type=Path, default=DEFAULT_CHARTS,
                        help=f"the directory holding the base and istiod charts (default {DEFAULT_CHARTS})")
    parser.add_argument("--helm", default=default_helm(), help="the helm binary (default: $HELM, else helm on PATH)")


def run_manifest(args: argparse.Namespace) -> int:
    try:
        operator = yaml.safe_load(args.filename.read_text()) if args.filename else {}
        sys.stdout.write(render(to_install(with_sets(operator, args.sets)), args.charts, args.helm))
    except (OSError, yaml.YAMLError, SpecError, RenderError) as error:
        print(f"istiod manifest generate: {error}", file=sys.stderr)
        return 1
    return 0

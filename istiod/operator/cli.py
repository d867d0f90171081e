"""`istiod manifest generate` and `istiod install` (`[-f iop.yaml] [--set path=value]`): flags and runs."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import yaml

from istiod.durations import parse_duration
from istiod.operator.install import InstallError, install
from istiod.operator.manifest import DEFAULT_CHARTS, RenderError, default_helm, render
from istiod.operator.spec import SpecError, to_install, with_sets


def add_manifest_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", type=Path, help="an IstioOperator YAML file (default: the default profile)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="PATH=VALUE",
                        help="override a field of the spec, e.g. components.pilot.k8s.replicaCount=3 (repeatable)")
    parser.add_argument("-r", "--revision", help="install this control plane revision (istio.io/rev) beside the others: "
                        "the same as --set revision=<revision>")
    parser.add_argument("--charts", type=Path, default=DEFAULT_CHARTS,
                        help=f"the directory holding the base and istiod charts (default {DEFAULT_CHARTS})")
    parser.add_argument("--helm", default=default_helm(),
                        help="the helm binary (default: $HELM, else helm on PATH, else the one `make helm-bin` built)")


def add_install_flags(parser: argparse.ArgumentParser) -> None:
    add_manifest_flags(parser)
    parser.add_argument("--kubeconfig", type=Path, help="the cluster to install in (default: the in-cluster config)")
    parser.add_argument("--readiness-timeout", type=parse_duration, default=300.0,
                        help="how long to wait for istiod to roll out (default 300s)")


def run_manifest(args: argparse.Namespace) -> int:
    """`manifest generate` prints the manifests; `install` applies them and waits for istiod."""
    command = "install" if args.command == "install" else "manifest generate"
    try:
        operator = yaml.safe_load(args.filename.read_text()) if args.filename else {}
        sets = [*args.sets, *([f"revision={args.revision}"] if args.revision is not None else [])]
        spec = to_install(with_sets(operator, sets))
        manifests = render(spec, args.charts, args.helm)
        if command == "install":
            objects = [o for o in yaml.safe_load_all(manifests) if o]
            asyncio.run(install(objects, spec.namespace, args.kubeconfig, args.readiness_timeout))
        else:
            sys.stdout.write(manifests)
    except (OSError, yaml.YAMLError, SpecError, RenderError, InstallError) as error:
        print(f"istiod {command}: {error}", file=sys.stderr)
        return 1
    return 0

"""`istiod manifest generate`: an IstioOperator rendered by helm from the charts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from istiod.operator.spec import Install

# In a checkout (or an editable install) the charts are next to the package, and so is the helm that
# `make helm-bin` builds.
CHECKOUT = Path(__file__).resolve().parents[2]
DEFAULT_CHARTS = CHECKOUT / "deploy" / "charts"
BUILT_HELM = CHECKOUT / ".cache" / "helm-bin" / "helm"


class RenderError(RuntimeError):
    """helm is missing or refused the charts; the message says which and why."""


def default_helm() -> str:
    """$HELM, else helm on PATH, else the one `make helm-bin` built in this checkout."""
    if "HELM" in os.environ:
        return os.environ["HELM"]
    if shutil.which("helm") is None and BUILT_HELM.is_file():
        return str(BUILT_HELM)
    return "helm"


def render(install: Install, charts: Path, helm: str) -> str:
    """The manifests of each chart enabled, in the order base, istiod, cni, ztunnel, as `helm template`
    prints them."""
    charts_values: tuple[tuple[str, bool, Mapping[str, Any]], ...] = (
        ("base", install.base, {}), ("istiod", install.istiod, install.values),
        ("cni", install.cni, install.cni_values), ("ztunnel", install.ztunnel, {}),
    )
    releases = {name: values for name, enabled, values in charts_values if enabled}
    out = []
    with tempfile.TemporaryDirectory(prefix="istiod-manifest-") as tmp:
        for name, values in releases.items():
            values_file = Path(tmp) / f"{name}.json"
            values_file.write_text(json.dumps(values))  # JSON is YAML: helm reads it as a values file
            command = [helm, "template", name, str(charts / name), "--namespace", install.namespace, "-f", str(values_file)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            except FileNotFoundError:
                raise RenderError(f"helm not found ({helm}); set --helm or HELM, or build it in this checkout:"
                                  " `make helm-bin` (needs Go)") from None
            if done.returncode != 0:
                raise RenderError(f"helm template {name}: {done.stderr.strip()}")
            out.append(done.stdout)
    return "".join(out)

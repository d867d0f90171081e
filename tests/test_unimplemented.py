"""Objects of Istio's kinds this istiod does not implement: one warning per object and generation."""

from __future__ import annotations

import logging

import pytest

from istiod.sources.unimplemented import UnimplementedReporter


def _filter(name: str, generation: int) -> dict[str, object]:
    return {"apiVersion": "extensions.istio.io/v1alpha1", "kind": "WasmPlugin",
            "metadata": {"name": name, "namespace": "shop", "generation": generation}}


def test_one_warning_per_object_and_generation(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "istiod.sources.unimplemented")
    reporter = UnimplementedReporter()
    reporter.replace("WasmPlugin", [{k: v for k, v in _filter("lua", 1).items() if k != "kind"}])
    reporter.apply(_filter("lua", 1))  # a watch event for what the list had: said already
    reporter.apply(_filter("lua", 2))  # edited
    reporter.apply({**_filter("lua", 1), "apiVersion": "example.com/v1"})  # another group's WasmPlugin
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(line.startswith("config not implemented object=WasmPlugin/shop/lua reason=")
                                   and "WasmPlugin is not implemented by this istiod" in line for line in lines)
    reporter.delete(_filter("lua", 2))
    reporter.apply(_filter("lua", 2))  # created again: said again
    reporter.replace("WasmPlugin", [])  # gone while not watched
    reporter.apply(_filter("lua", 2))
    assert len(caplog.records) == 4

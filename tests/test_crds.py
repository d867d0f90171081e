"""crds/ agrees with the kinds istiod reads: groups, versions (served, storage), names, columns."""

from __future__ import annotations

from pathlib import Path

import yaml

from istiod.model.config.kinds import CONFIG_KINDS

CRDS = Path(__file__).parent.parent / "crds"


def load() -> dict[str, dict]:
    docs = [d for path in sorted(CRDS.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text())]
    return {d["metadata"]["name"]: d for d in docs}


def test_every_kind_has_its_crd() -> None:
    crds = load()
    assert set(crds) == {k.resource for k in CONFIG_KINDS}
    for kind in CONFIG_KINDS:
        spec = crds[kind.resource]["spec"]
        assert spec["group"] == kind.group and spec["scope"] == "Namespaced"
        assert spec["names"]["kind"] == kind.kind and spec["names"]["plural"] == kind.plural
        assert tuple(spec["names"].get("shortNames", ())) == kind.short_names
        assert [v["name"] for v in spec["versions"] if v["served"]] == list(kind.versions)
        assert [v["name"] for v in spec["versions"] if v["storage"]] == [kind.storage]


def test_printer_columns_as_istio() -> None:
    crds = load()

    def columns(resource: str) -> list[str]:
        return [c["name"] for c in crds[resource]["spec"]["versions"][0].get("additionalPrinterColumns", [])]

    assert columns("virtualservices.networking.istio.io") == ["Gateways", "Hosts", "Age"]
    assert columns("destinationrules.networking.istio.io") == ["Host", "Age"]
    assert columns("serviceentries.networking.istio.io") == ["Hosts", "Location", "Resolution", "Age"]
    assert columns("peerauthentications.security.istio.io") == ["Mode", "Age"]
    assert columns("authorizationpolicies.security.istio.io") == ["Action", "Age"]

"""Strategic merge patch as the API server applies it to the kinds a Gateway's overlays patch: maps
merge, keyed lists merge by their key, other lists are replaced, null deletes, and the directives."""

from __future__ import annotations

import pytest

from istiod.model.strategic_merge import SCHEMAS, PatchError, strategic_merge

DEPLOYMENT = {
    "kind": "Deployment",
    "metadata": {"name": "web", "labels": {"a": "1", "b": "2"}, "finalizers": ["x"]},
    "spec": {"template": {"spec": {
        "containers": [{"name": "istio-proxy", "image": "p:1",
                        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                        "args": ["proxy", "router"],
                        "resources": {"limits": {"cpu": "2"}}}],
        "volumes": [{"name": "data", "emptyDir": {}}, {"name": "token", "projected": {}}],
        "tolerations": [{"key": "old"}]}}},
}


def merge(patch: dict) -> dict:
    return strategic_merge(DEPLOYMENT, patch, SCHEMAS["Deployment"])


def test_maps_merge_keyed_lists_merge_by_key_and_other_lists_are_replaced() -> None:
    merged = merge({"metadata": {"labels": {"b": None, "c": "3"}, "finalizers": ["y"]},
                    "spec": {"replicas": 2, "template": {"spec": {
                        "containers": [{"name": "istio-proxy", "env": [{"name": "B", "value": "two"}, {"name": "C", "value": "3"}],
                                        "args": ["only"], "resources": {"requests": {"cpu": "100m"}}},
                                       {"name": "extra", "image": "e:1"}],
                        "tolerations": [{"key": "new"}]}}}})
    assert merged["metadata"]["labels"] == {"a": "1", "c": "3"}
    assert merged["metadata"]["finalizers"] == ["x", "y"]
    assert merged["spec"]["replicas"] == 2
    proxy, extra = merged["spec"]["template"]["spec"]["containers"]
    assert proxy["image"] == "p:1" and proxy["args"] == ["only"]
    assert proxy["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "two"}, {"name": "C", "value": "3"}]
    assert proxy["resources"] == {"limits": {"cpu": "2"}, "requests": {"cpu": "100m"}}
    assert extra == {"name": "extra", "image": "e:1"}
    assert merged["spec"]["template"]["spec"]["tolerations"] == [{"key": "new"}]
    assert DEPLOYMENT["metadata"]["labels"] == {"a": "1", "b": "2"}  # the original is untouched


def test_directives() -> None:
    spec = {"spec": {"template": {"spec": {"volumes": [{"name": "data", "$patch": "delete"}]}}}}
    assert [v["name"] for v in merge(spec)["spec"]["template"]["spec"]["volumes"]] == ["token"]
    spec = {"spec": {"template": {"spec": {"volumes": [{"$patch": "replace"}, {"name": "only", "emptyDir": {}}]}}}}
    assert merge(spec)["spec"]["template"]["spec"]["volumes"] == [{"name": "only", "emptyDir": {}}]
    replaced = merge({"metadata": {"labels": {"$patch": "replace", "z": "9"}}})
    assert replaced["metadata"]["labels"] == {"z": "9"}
    ordered = merge({"spec": {"template": {"spec": {"$setElementOrder/volumes": [{"name": "token"}, {"name": "data"}]}}}})
    assert [v["name"] for v in ordered["spec"]["template"]["spec"]["volumes"]] == ["token", "data"]
    dropped = merge({"metadata": {"$deleteFromPrimitiveList/finalizers": ["x"]}})
    assert dropped["metadata"]["finalizers"] == []
    retained = merge({"spec": {"template": {"spec": {"$retainKeys": ["containers"], "containers": []}}}})
    assert set(retained["spec"]["template"]["spec"]) == {"containers"}


@pytest.mark.parametrize("patch, message", [
    ({"spec": {"template": {"spec": {"containers": [{"image": "x"}]}}}}, "does not contain the merge key 'name'"),
    ({"spec": {"template": {"spec": {"containers": ["x"]}}}}, "an element is not a map"),
    ({"metadata": {"$patch": "merge-harder"}}, "unknown $patch directive"),
    ({"metadata": {"$bogus": 1}}, "metadata.$bogus: unknown directive"),
    ({"$patch": "delete"}, "deletes the whole object"),
])
def test_bad_patches_are_refused_naming_the_field(patch: dict, message: str) -> None:
    with pytest.raises(PatchError, match=message.replace("$", r"\$")):
        merge(patch)


def test_service_ports_merge_by_port() -> None:
    service = {"spec": {"ports": [{"name": "http", "port": 80}, {"name": "https", "port": 443}]}}
    merged = strategic_merge(service, {"spec": {"type": "NodePort", "ports": [{"port": 80, "nodePort": 30080}]}},
                             SCHEMAS["Service"])
    assert merged["spec"]["ports"] == [{"name": "http", "port": 80, "nodePort": 30080}, {"name": "https", "port": 443}]

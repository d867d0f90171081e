"""Structured logs: one line per connection event, push, NACK and source error; none per resource."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from istiod import logs
from istiod.xds import types
from tests.ads_client import AdsClient
from tests.conftest import CLIENT_PROXY, ECHO_HOST, ECHO_PORT, render, synced
from tests.peers import Istiod, Process, eventually, wait_until


def format_record(output: str, message: object, exc: bool = False) -> str:
    formatter = (logs.JsonFormatter if output == "json" else logs.KeyValueFormatter)()
    record = logging.LogRecord("istiod.xds.server", logging.WARNING, __file__, 1, message, (), None)
    if exc:
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            record.exc_info = sys.exc_info()
    return formatter.format(record)


def test_key_value_lines_quote_what_would_split_them() -> None:
    line = format_record("kv", logs.event("ads NACK", id="a~b", error='bad "thing"', reason={"Pod": 2, "Service": 1},
                                          n=3))
    assert line.startswith("time=") and line.endswith(
        ' level=warning scope=xds.server msg="ads NACK" id=a~b error="bad \\"thing\\"" reason=Pod:2,Service:1 n=3')
    assert "\n" not in format_record("kv", "failed", exc=True)


def test_any_handler_shows_an_event_with_its_facts() -> None:
    assert str(logs.event("ads NACK", id="a", error="no good")) == 'ads NACK id=a error="no good"'
    record = logging.LogRecord("x", logging.INFO, __file__, 1, logs.event("push", version="v/1"), (), None)
    assert record.getMessage() == "push version=v/1"
    assert json.loads(format_record("kv", "plain %s").split(" msg=", 1)[1]) == "plain %s"


def test_json_lines_carry_the_fields() -> None:
    record = json.loads(format_record("json", logs.event("push", version="v/1", reason={"Pod": 1})))
    assert record["level"] == "warning" and record["scope"] == "xds.server" and record["msg"] == "push"
    assert record["version"] == "v/1" and record["reason"] == {"Pod": 1} and record["time"].endswith("Z")
    failed = format_record("json", "failed", exc=True)
    assert "\n" not in failed and "boom\\nsecond line" in json.loads(failed)["error"]


@pytest.mark.parametrize("level", ["debug", "info"])
def test_setup_replaces_handlers(level: str) -> None:
    root = logging.getLogger()
    handlers, saved_level = root.handlers[:], root.level
    try:
        logs.setup(level, "json")
        assert len(root.handlers) == 1 and isinstance(root.handlers[0].formatter, logs.JsonFormatter)
        assert root.level == getattr(logging, level.upper())
    finally:
        root.handlers[:] = handlers
        root.setLevel(saved_level)


async def test_istiod_logs_one_json_line_per_event(
    mesh_dir: Path, start_istiod: Callable[..., Istiod], start_demo: Callable[..., Process],
    ads_client: Callable[..., AdsClient],
) -> None:
    (mesh_dir / "ns.yaml").write_text(render("namespace.yaml", namespace="echo-ns"))
    (mesh_dir / "svc.yaml").write_text(render("service.yaml", name="echo", namespace="echo-ns", port=ECHO_PORT))
    istiod = start_istiod(mesh_dir, log_format="json")
    client = start_demo("client", f"xds:///{ECHO_HOST}:{ECHO_PORT}", "--xds", istiod.xds_address, "--count", "0",
                        "--interval", "0.2", "--namespace", "echo-ns", name="client")
    wait_until(lambda: synced(istiod, CLIENT_PROXY, ("cluster", "listener", "route", "endpoint")), 15, "the client")
    (mesh_dir / "pod.yaml").write_text(render("pod.yaml", pod="echo-a", app="echo", namespace="echo-ns",
                                              ip="127.0.0.21", port=7071))
    (mesh_dir / "broken.yaml").write_text("kind: Service\nmetadata: {name: [unclosed\n")
    nacker = ads_client(istiod, "nacker", "echo-ns")
    await nacker.subscribe(types.CLUSTER, [f"outbound|{ECHO_PORT}||{ECHO_HOST}"], nack="no thanks")
    await eventually(lambda: "no thanks" in str(istiod.get("/debug/syncz")[1]), 5, "the NACK")
    await nacker.close()
    client.stop()

    def events() -> list[dict]:
        return [json.loads(line) for line in istiod.output if line.startswith("{")]

    await eventually(lambda: sum(e["msg"] == "ads disconnected" for e in events()) == 2, 5, "both disconnects")
    await eventually(lambda: any("broken.yaml" in e["msg"] for e in events()), 5, "the source error")
    await eventually(lambda: any(e.get("reason") == {"Pod": 1} for e in events()), 5, "the pod's push")
    records = events()
    assert len(records) == len(istiod.output), "every line is one JSON object"
    by_message: dict[str, list[dict]] = {}
    for record in records:
        by_message.setdefault(record["msg"].split(":")[0], []).append(record)
    assert [r["id"].rsplit("-", 1)[0] for r in by_message["ads connected"]] == [
        CLIENT_PROXY, "sidecar~127.0.0.1~nacker.echo-ns~echo-ns.svc.cluster.local"]
    assert all(r["peer"].startswith("ipv4:127.0.0.1:") for r in by_message["ads connected"])
    [nack] = by_message["ads NACK"]
    assert (nack["level"], nack["type"], nack["error"]) == ("warning", "cds", "no thanks")
    pushes = by_message["push"]
    assert [p["reason"] for p in pushes] == [{"Namespace": 1, "Service": 1}, {"Pod": 1}]
    assert all(p["level"] == "info" and p["version"] for p in pushes)
    [source_error] = [r for r in records if "broken.yaml" in r["msg"]]
    assert source_error["level"] == "error" and "keeping its last good objects" in source_error["msg"]
    assert len(by_message["ads disconnected"]) == 2
    # Nothing per resource: no line names a cluster, listener or route.
    resources = (f"outbound|{ECHO_PORT}||{ECHO_HOST}", f"{ECHO_HOST}:{ECHO_PORT}")
    assert [r for r in records if any(name in json.dumps(r) for name in resources)] == []

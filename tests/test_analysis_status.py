"""The status istiod's analysis writes (istiod/status/analysis.py): its fields as istiod's status manager
writes them, and nothing written when nothing changes."""

from __future__ import annotations

from typing import Any

from istiod.model.config.analysis import Message, Resource
from istiod.status.analysis import desired_status

BODY: dict[str, Any] = {"kind": "VirtualService", "metadata": {"name": "r", "namespace": "demo", "generation": 4},
                        "spec": {"hosts": ["r"]}}
VS = Resource("VirtualService", "demo", "r", BODY)
MISSING = Message("IST0101", VS, ("gateway", '"gw"'))
IST0101 = {"type": {"code": "IST0101"}, "level": "ERROR",
           "documentationUrl": "https://istio.io/v1.31/docs/reference/config/analysis/ist0101/"}


def test_messages_and_the_generation_analyzed() -> None:
    conditions = [{"type": "Reconciled", "status": "True"}]
    body = {**BODY, "status": {"conditions": conditions}}
    assert desired_status(body, [MISSING]) == {"conditions": conditions, "observedGeneration": "4",
                                               "validationMessages": [IST0101]}


def test_nothing_to_write() -> None:
    assert desired_status(BODY, []) is None  # never had a message: istiod leaves its status alone
    shown = {**BODY, "status": {"observedGeneration": "4", "validationMessages": [IST0101]}}
    assert desired_status(shown, [MISSING]) is None  # already shows exactly this


def test_a_fixed_object_is_cleared() -> None:
    shown = {**BODY, "status": {"observedGeneration": "3", "validationMessages": [IST0101]}}
    assert desired_status(shown, []) == {"observedGeneration": "4"}

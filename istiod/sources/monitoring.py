"""Store changes as Istio's registry metrics: pilot_k8s_reg_events and pilot_inbound_updates."""

from __future__ import annotations

from istiod import metrics
from istiod.sources.store import Change, EventType

_EVENTS = {EventType.ADDED: "add", EventType.UPDATED: "update", EventType.DELETED: "delete"}


def record_change(change: Change) -> None:
    """A Store listener: count one change by kind and event, and by Istio's update type."""
    kind = change.key.kind
    metrics.K8S_REG_EVENTS.labels(type=kind, event=_EVENTS[change.type]).inc()
    update = metrics.update_type(kind)
    if update == "svc" and change.type is EventType.DELETED:
        update = "svcdelete"  # Istio counts Service deletions apart from other Service updates
    metrics.INBOUND_UPDATES.labels(type=update).inc()

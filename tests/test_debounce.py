"""The pusher's debounce, as istiod's: quiet window and max for config changes, the incremental EDS
path for changes that only move endpoints. Decisions on a fake clock; the loop with short timings
and no timed assertion."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from istiod.sources.store import Store
from istiod.xds.pusher import Pusher, PushEvent
from tests.peers import eventually


def service(name: str) -> dict:
    return {"kind": "Service", "metadata": {"name": name, "namespace": "demo"},
            "spec": {"selector": {"app": name}, "ports": [{"name": "grpc", "port": 80}]}}


def pod(name: str, ip: str) -> dict:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "demo", "labels": {"app": "a"}},
            "spec": {"containers": [{"ports": [{"containerPort": 80}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pusher(eds_debounce: bool = True) -> tuple[Store, Pusher, Clock]:
    store, clock = Store(), Clock()
    return store, Pusher(store, debounce_after=0.1, debounce_max=10.0, eds_debounce=eds_debounce, clock=clock), clock


def test_config_changes_wait_for_quiet_or_the_max() -> None:
    store, push, clock = pusher()
    store.apply(service("a"))
    assert push.due_in(clock.now) == pytest.approx(0.1)
    clock.now = 0.05
    store.apply(service("b"))  # not quiet yet: the window starts again from here
    assert push.due_in(0.1) == pytest.approx(0.05)
    for step in range(1, 200):  # a change every 50 ms for 10 s: never quiet, so the max decides
        clock.now = 0.05 * step
        store.apply(service(f"s{step}"))
    assert push.due_in(clock.now) == pytest.approx(10.0 - clock.now)
    assert push.due_in(10.0) == 0.0


def test_endpoint_changes_are_published_after_the_quiet_window_from_the_first() -> None:
    store, push, clock = pusher()
    store.apply(pod("a-1", "10.0.0.1"))
    clock.now = 0.05
    store.apply(pod("a-1", "10.0.0.2"))  # churn does not push the window out
    assert push.due_in(0.05) == pytest.approx(0.05)
    assert push.due_in(0.1) == 0.0
    push.publish()
    clock.now = 1.0
    store.apply(pod("a-1", "10.0.0.3"))  # a new window after the push
    assert push.due_in(1.0) == pytest.approx(0.1)


def test_endpoint_changes_join_pending_config_changes() -> None:
    store, push, clock = pusher()
    store.apply(pod("a-1", "10.0.0.1"))
    clock.now = 0.08
    store.apply(service("a"))  # now the whole batch is debounced as istiod merges requests
    assert push.due_in(0.1) == pytest.approx(0.08)
    push.publish()
    store.apply(pod("a-1", "10.0.0.2"))  # after the push: endpoints only again
    assert push.due_in(clock.now) == pytest.approx(0.1)


def test_without_eds_debounce_endpoint_changes_go_at_once_but_config_still_waits() -> None:
    store, push, clock = pusher(eds_debounce=False)
    store.apply(pod("a-1", "10.0.0.1"))
    assert push.due_in(clock.now) == 0.0
    store.apply(service("a"))
    assert push.due_in(clock.now) == pytest.approx(0.1)


async def test_endpoint_churn_is_pushed_while_it_goes_on() -> None:
    """Changes every few ms never leave a quiet window, and the max is an hour: endpoint pushes
    still happen during the churn; a config change after it is pushed once quiet."""
    store = Store()
    store.apply(service("a"))
    push = Pusher(store, debounce_after=0.02, debounce_max=3600)
    events: list[PushEvent] = []
    push.subscribe(events.append)
    runner = asyncio.create_task(push.run())
    churning = True

    async def churn() -> None:
        for n in itertools.count():
            if not churning:
                return
            store.apply(pod("a-1", f"10.0.{n // 250 % 250}.{n % 250 + 1}"))
            await asyncio.sleep(0.002)

    churner = asyncio.create_task(churn())
    try:
        await eventually(lambda: len(events) >= 3, 30, "pushes during endpoint churn")
        assert all(set(e.reason) == {"Pod"} for e in events)
        churning = False
        await churner
        store.apply(service("b"))
        await eventually(lambda: "Service" in events[-1].reason, 30, "the config change pushed once quiet")
        final = store.get(next(iter(store.keys("Pod"))))
        assert final is not None
        assert [e.address for e in push.snapshot.endpoints_for("a.demo.svc.cluster.local", 80)] == [final.value.ip]
    finally:
        churning = False
        runner.cancel()
        churner.cancel()

"""The per-port connection cap: idle connections give way to new ones, busy ones never do."""

from __future__ import annotations

from istiod.connlimit import ConnectionCap


def test_the_longest_idle_connection_gives_way_and_busy_ones_stay() -> None:
    closed: list[str] = []
    cap = ConnectionCap(3)
    for name in "abc":
        assert cap.admit(name, lambda name=name: closed.append(name))
    cap.busy("a")
    cap.busy("c")
    cap.idle("c")  # c finished its request after b went idle: b has waited longest
    assert cap.admit("d", lambda: closed.append("d")) and closed == ["b"]
    assert cap.admit("e", lambda: closed.append("e")) and closed == ["b", "c"]
    cap.busy("d")
    cap.busy("e")
    assert not cap.admit("f", lambda: closed.append("f"))  # every connection busy: refused
    cap.release("a")
    assert cap.admit("f", lambda: closed.append("f")) and len(cap) == 3 and closed == ["b", "c"]

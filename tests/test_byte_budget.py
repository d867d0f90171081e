"""The byte budget of ADS writes: first come first served, never over its limit, cancellation safe, and
fair: a connection holds at most its share, and a write that does not finish loses its claim."""

import asyncio

import pytest

from istiod.xds.budget import ByteBudget


async def test_writes_beyond_the_budget_wait_in_order() -> None:
    budget = ByteBudget(100, share=100)
    first = await budget.acquire(60)
    order: list[str] = []

    async def write(name: str, size: int) -> None:
        held = await budget.acquire(size)
        order.append(name)
        assert budget.used <= budget.limit
        budget.release(held)

    # 50 does not fit; 10 would, but waits behind it: no write is overtaken for good by smaller ones.
    tasks = [asyncio.create_task(write("big", 50)), asyncio.create_task(write("small", 10))]
    await asyncio.sleep(0)
    assert order == []
    budget.release(first)
    await asyncio.gather(*tasks)
    assert order == ["big", "small"]
    assert budget.used == 0


async def test_a_write_larger_than_the_budget_goes_alone() -> None:
    budget = ByteBudget(100, share=100)
    held = await budget.acquire(1000)
    assert held.size == 100 and budget.used == 100
    budget.release(held)
    assert budget.used == 0


@pytest.mark.parametrize("granted_first", [False, True])
async def test_a_cancelled_waiter_gives_back_what_it_had_or_its_place(granted_first: bool) -> None:
    budget = ByteBudget(100, share=100)
    first = await budget.acquire(100)
    waiter = asyncio.create_task(budget.acquire(80))
    behind = asyncio.create_task(budget.acquire(20))
    await asyncio.sleep(0)
    if granted_first:
        budget.release(first)  # grants the waiter, whose task is cancelled before it runs
        waiter.cancel()
    else:
        waiter.cancel()
        await asyncio.sleep(0)
        budget.release(first)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (await asyncio.wait_for(behind, 1)).size == 20
    assert budget.used == 20


async def test_a_connection_at_its_share_holds_back_only_itself() -> None:
    budget = ByteBudget(100, share=30)
    first = await budget.acquire(30, "hostile")
    more = asyncio.create_task(budget.acquire(10, "hostile"))  # past its share: waits
    await asyncio.sleep(0)
    assert not more.done()
    # Another connection is served at once, though the hostile one's write came first.
    other = await asyncio.wait_for(budget.acquire(30, "fresh"), 1)
    assert budget.owner_used("hostile") == 30 and budget.used == 60
    budget.release(first)
    budget.release(await asyncio.wait_for(more, 1))
    budget.release(other)
    assert budget.used == 0 and budget.owner_used("hostile") == budget.owner_used("fresh") == 0


async def test_a_write_that_does_not_finish_loses_its_claim_but_not_its_share() -> None:
    budget = ByteBudget(100, share=50, stall=0.05)
    stalled = [await budget.acquire(50, "a"), await budget.acquire(50, "b")]  # clients that never read
    fresh = asyncio.create_task(budget.acquire(40, "fresh"))
    await asyncio.sleep(0)
    assert not fresh.done()
    # Served once the stalled writes lose their claim, while they are still under way.
    claim = await asyncio.wait_for(fresh, 2)
    assert budget.used == 40
    assert budget.owner_used("a") == 50  # still its whole share: its next write waits
    again = asyncio.create_task(budget.acquire(10, "a"))
    await asyncio.sleep(0.1)
    assert not again.done()
    for held in stalled:
        budget.release(held)  # the send deadline closed their streams
    budget.release(await asyncio.wait_for(again, 1))
    budget.release(claim)
    assert budget.used == 0 and not budget._owners

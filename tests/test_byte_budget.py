"""The byte budget of ADS writes: first come first served, never over its limit, cancellation safe."""

import asyncio

import pytest

from istiod.xds.budget import ByteBudget


async def test_writes_beyond_the_budget_wait_in_order() -> None:
    budget = ByteBudget(100)
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
    budget = ByteBudget(100)
    held = await budget.acquire(1000)
    assert held == 100 and budget.used == 100
    budget.release(held)
    assert budget.used == 0


@pytest.mark.parametrize("granted_first", [False, True])
async def test_a_cancelled_waiter_gives_back_what_it_had_or_its_place(granted_first: bool) -> None:
    budget = ByteBudget(100)
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
    assert await asyncio.wait_for(behind, 1) == 20
    assert budget.used == 20

"""The runner's shared time limits (proxy/tasks/deadlines.py) keep asyncio.timeout's semantics."""

from __future__ import annotations

import asyncio
import math

import pytest

from mcp_tasks_proxy.tasks.deadlines import Deadlines


async def test_an_expired_limit_raises_timeout_error() -> None:
    deadlines = Deadlines()
    with pytest.raises(TimeoutError), deadlines.limit(0.05):
        await asyncio.sleep(5)
    assert asyncio.current_task().cancelling() == 0  # the cancel it made is taken back


async def test_an_infinite_limit_never_ends() -> None:
    deadlines = Deadlines()
    with deadlines.limit(math.inf):
        await asyncio.sleep(0.01)
    assert deadlines._buckets == {}


async def test_a_block_that_ends_in_time_is_not_cancelled_later() -> None:
    deadlines = Deadlines()
    with deadlines.limit(0.05):
        await asyncio.sleep(0)
    await asyncio.sleep(0.2)  # past the limit's tick: nothing cancels this task
    assert deadlines._buckets == {}


async def test_limits_that_end_early_keep_neither_their_tenth_nor_its_timer() -> None:
    """Calls that end long before their limit (most do, under timeout_s of an hour) leave nothing waiting for it:
    not one set per tenth of a second, however many were in it, and not one timer."""
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    for i in range(300):  # 300 tenths of a second an hour ahead, each limit ended at once
        with deadlines.limit(3600 + i / 10):
            pass
    held = [deadlines.limit(7200) for _ in range(1000)]  # a burst in one tenth, then all end
    for limit in held:
        limit.__enter__()
    for limit in held:
        limit.__exit__(None, None, None)
    assert deadlines._buckets == {} and deadlines._timers == {}
    timers = [h for h in loop._scheduled if h._callback == deadlines._expire]  # type: ignore[attr-defined]
    assert all(handle.cancelled() for handle in timers)


async def test_limits_ending_together_share_one_timer() -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    before = len(loop._scheduled)  # type: ignore[attr-defined]

    never = asyncio.Event()

    async def limited() -> str:
        try:
            with deadlines.limit(0.3):
                await never.wait()  # no timer of its own
        except TimeoutError:
            return "timeout"
        return "ended"

    runs = [asyncio.create_task(limited()) for _ in range(200)]
    await asyncio.sleep(0)
    assert len(deadlines._buckets) <= 2  # 200 limits, one or two tenths of a second
    assert len(loop._scheduled) - before <= 2  # type: ignore[attr-defined]
    assert await asyncio.gather(*runs) == ["timeout"] * 200


async def test_a_cancel_from_outside_stays_a_cancel() -> None:
    deadlines = Deadlines()
    started = asyncio.Event()

    async def limited() -> None:
        with deadlines.limit(5):
            started.set()
            await asyncio.sleep(5)

    run = asyncio.create_task(limited())
    await started.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert deadlines._buckets == {} or all(not bucket for bucket in deadlines._buckets.values())


async def test_a_cancel_from_outside_racing_the_expiry_stays_a_cancel() -> None:
    deadlines = Deadlines()

    async def limited() -> None:
        with deadlines.limit(0):
            await asyncio.sleep(5)

    run = asyncio.create_task(limited())
    await asyncio.sleep(0)
    run.cancel()  # the outside cancel comes first; the expiry adds a second one
    await asyncio.sleep(0.15)
    with pytest.raises(asyncio.CancelledError):
        await run

"""Background loops that stop even when a cancel is absorbed on its way through a step."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

from common.periodic import Periodic


async def test_steps_repeat_at_the_interval_until_stopped() -> None:
    steps: list[float] = []
    enough = asyncio.Event()

    async def step() -> None:
        steps.append(time.monotonic())
        if len(steps) == 4:
            enough.set()

    loop = Periodic(step, 0.05, "test")
    loop.start()
    await asyncio.wait_for(enough.wait(), 5.0)
    await asyncio.wait_for(loop.stop(), 1.0)  # its wait is cut short, not sat out
    gaps = [later - earlier for earlier, later in itertools.pairwise(steps)]
    assert all(gap >= 0.045 for gap in gaps), gaps
    count = len(steps)
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(steps) == count


async def test_wait_first_skips_the_immediate_step() -> None:
    steps = 0

    async def step() -> None:
        nonlocal steps
        steps += 1

    loop = Periodic(step, 10.0, "test")
    loop.start(wait_first=True)
    for _ in range(5):
        await asyncio.sleep(0)
    assert steps == 0
    await asyncio.wait_for(loop.stop(), 1.0)


async def test_a_step_that_absorbs_the_cancel_still_ends_the_loop() -> None:
    """What redis-py does to a cancel landing inside a command: the command returns normally."""
    inside = asyncio.Event()

    async def absorbing_step() -> None:
        inside.set()
        with contextlib.suppress(asyncio.CancelledError):  # absorbed
            await asyncio.sleep(10)

    loop = Periodic(absorbing_step, 0.01, "test")
    loop.start()
    await inside.wait()
    await asyncio.wait_for(loop.stop(), 1.0)

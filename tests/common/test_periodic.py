"""Background loops that stop even when a cancel is absorbed on its way through a step."""

from __future__ import annotations

import asyncio
import contextlib
import time

from common.periodic import Periodic


async def test_steps_repeat_at_the_interval_until_stopped() -> None:
    steps: list[float] = []

    async def step() -> None:
        steps.append(time.monotonic())

    loop = Periodic(step, 0.05, "test")
    loop.start()
    await asyncio.sleep(0.28)
    started = time.monotonic()
    await loop.stop()
    assert time.monotonic() - started < 0.05  # a wait is cut short at once
    count = len(steps)
    assert 4 <= count <= 7, steps
    await asyncio.sleep(0.12)
    assert len(steps) == count


async def test_wait_first_skips_the_immediate_step() -> None:
    steps = 0

    async def step() -> None:
        nonlocal steps
        steps += 1

    loop = Periodic(step, 0.2, "test")
    loop.start(wait_first=True)
    await asyncio.sleep(0.05)
    assert steps == 0
    await loop.stop()


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

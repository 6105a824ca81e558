"""The replicas' control channel against a real redis-server: wakes are coalesced, never lost."""

from __future__ import annotations

import asyncio
import logging

import pytest

from common.redis_client import connect
from scheduler_service.store.control_channel import WAKE, ControlChannel

CHANNEL = "baton-test:control"


async def _received(channel: ControlChannel, into: list[str]) -> None:
    async for payload in channel.messages():
        into.append(payload)


async def _wait_sent(channel: ControlChannel) -> None:
    while channel._waker is not None:
        await asyncio.sleep(0.01)


async def test_a_burst_of_wakes_is_one_publish_and_a_wake_during_a_publish_is_one_more(redis_url: str) -> None:
    publisher, subscriber = connect(redis_url), connect(redis_url)
    sender, listener = ControlChannel(publisher, CHANNEL), ControlChannel(subscriber, CHANNEL)
    got: list[str] = []
    reader = asyncio.create_task(_received(listener, got))
    try:
        await asyncio.sleep(0.3)  # subscribed by then
        for _ in range(20):  # one loop turn: all before the publish starts
            sender.wake_others()
        await _wait_sent(sender)
        await asyncio.sleep(0.2)
        assert got == [WAKE]
        got.clear()
        sender.wake_others()
        await asyncio.sleep(0)  # the publish is in flight now
        sender.wake_others()  # asked for during it: sent again after it
        await _wait_sent(sender)
        await asyncio.sleep(0.2)
        assert got == [WAKE, WAKE]
    finally:
        reader.cancel()
        await publisher.aclose()
        await subscriber.aclose()


async def test_a_wake_that_cannot_be_sent_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    dead = connect("redis://127.0.0.1:1/0")  # nothing listens there
    channel = ControlChannel(dead, CHANNEL)
    with caplog.at_level(logging.WARNING, logger="scheduler_service.store.control_channel"):
        channel.wake_others()
        await asyncio.wait_for(_wait_sent(channel), timeout=30)
    assert "could not wake the other replicas" in caplog.text
    await dead.aclose()

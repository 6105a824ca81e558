"""Fixtures for the scheduler service tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator

import pytest

from common.redis_client import connect
from scheduler_service.store import Store
from tests.process_stack import ProcessStack
from tests.scheduler_service.store_helpers import KEYS, TTL_S


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    client = connect(redis_url)
    yield Store(client, KEYS, request_ttl_s=TTL_S)
    await client.aclose()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that ran Baton as processes shows their logs' tails: the temporary directory
    that holds them is gone by the time anyone reads CI's output."""
    report = yield
    stack = getattr(item, "funcargs", {}).get("processes")
    if report.when == "call" and report.failed and isinstance(stack, ProcessStack):
        for log in sorted(stack.workdir.glob("*.log")):
            report.sections.append((f"process log {log.name}", log.read_text(errors="replace")[-3000:]))
    return report

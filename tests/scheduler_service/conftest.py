"""Fixtures for the scheduler service tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from common.redis_client import connect
from scheduler_service.store import Store
from tests.scheduler_service.store_helpers import KEYS, TTL_S


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    client = connect(redis_url)
    yield Store(client, KEYS, request_ttl_s=TTL_S)
    await client.aclose()

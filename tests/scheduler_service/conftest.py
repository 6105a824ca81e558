"""Fixtures for the scheduler service tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from common.redis_client import connect
from scheduler_service.request_store import RequestStore
from tests.scheduler_service.store_helpers import KEYS, TTL_S


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RequestStore]:
    client = connect(redis_url)
    yield RequestStore(client, KEYS, request_ttl_s=TTL_S)
    await client.aclose()

"""The event loop the services run on: uvloop where it is installed, else asyncio's own.

Why: a scheduler's work is the event loop itself, running gRPC's callbacks and redis-py's replies
for every streamed token, and an executor's loop carries its plans and reports. On uvloop (libuv,
the loop uvicorn and vLLM's API server pick) the same work costs the scheduler a tenth to a
quarter less CPU. uvloop has no Windows build; there the services run on asyncio's loop.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def uvloop_available() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop where it is installed."""
    if uvloop_available():
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)

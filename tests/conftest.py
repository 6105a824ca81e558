"""Shared fixtures: a real redis-server on a free port, the generated tiny model, a stack serving it
in process, and one run as separate processes."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from executor_service.cpu_threads import prefer_brief_openmp_spin

if TYPE_CHECKING:
    from tests.process_stack import ProcessStack
    from tests.stack import Stack

# Engines run in this process too, and their thread governor may give light steps both cores; as in
# the executor, idle OpenMP workers must then sleep rather than spin beside the services the tests
# start. Set before any test module imports torch (this module does not).
prefer_brief_openmp_spin()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A throwaway redis-server process on a free loopback port."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.workdir = workdir
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait_ready(self) -> None:
        self._wait_ready_on(self.port)

    @staticmethod
    def _wait_ready_on(port: int) -> None:
        """Wait until something answers Redis's protocol on ``port`` (a NOAUTH error counts)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16)[:1] in (b"+", b"-"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def flush(self) -> None:
        subprocess.run(["redis-cli", "-p", str(self.port), "FLUSHALL"], check=True, capture_output=True)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A clean database for one test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated tiny Llama model and tokenizer, made once per session."""
    from baton.make_model import make_model

    out = tmp_path_factory.mktemp("tiny-model")
    make_model(out, size="tiny", seed=0)
    return out


@pytest.fixture
async def stack(redis_url: str, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    """A scheduler and one executor of the tiny model, in process, on the shared redis-server."""
    from tests.stack import stack_config, start_stack  # imports torch, which this module must not at load

    running = await start_stack(stack_config(redis_url, tiny_model_dir))
    yield running
    await running.stop()


@pytest.fixture
def processes(tmp_path: Path, tiny_model_dir: Path) -> Iterator[ProcessStack]:
    """A redis-server with AOF, in a process of its own; the test starts the services it kills."""
    from tests.process_stack import ProcessStack

    stack = ProcessStack(tmp_path, tiny_model_dir)
    stack.start_redis()
    yield stack
    stack.stop_all()


@pytest.fixture(scope="session", autouse=True)
async def _no_task_outlives_the_session() -> AsyncIterator[None]:
    """Cancel what a test left running on the session's event loop, again and again if need be.

    pytest-asyncio cancels leftover tasks once when it closes the loop and then waits for them. A
    task whose cleanup retries Redis calls (a link handing back its requests, with up to
    ``redis_retry_s`` of backoff each) against a server already stopped would hold the whole run
    for minutes. One CI run hung there, on what was most likely such a task (a full run after it
    left none). Each cancel interrupts the await the task is in. What is
    left, and what still runs after 15 s, is named on the terminal, so the leak can be found.
    """
    yield
    current = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is not current and not task.done():
            print(f"task left running at the end of the session: {task.get_coro()!r}", file=sys.__stderr__)
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        pending = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        if not pending:
            return
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.5)
    for task in asyncio.all_tasks():
        if task is not current and not task.done():
            print(f"task still running at the end of the session: {task!r}", file=sys.__stderr__)

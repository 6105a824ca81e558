"""The entrypoints' shared server and shutdown: a burst of calls is served, not cancelled; a graceful
stop that hangs ends anyway, saying where it hung."""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import service

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=20, check=False
    )


def test_a_hung_shutdown_exits_saying_where_it_hung() -> None:
    script = textwrap.dedent(
        """
        import asyncio, logging, threading, time
        from common import service

        def stuck_thread():
            time.sleep(30)

        async def stuck_await():
            await asyncio.Event().wait()

        async def main():
            service.bound_shutdown(1.0)
            await asyncio.gather(asyncio.to_thread(stuck_thread), stuck_await())

        logging.basicConfig()
        asyncio.run(main())
        """
    )
    done = _run(script)
    assert done.returncode != 0
    waiting, threads = done.stderr.split("Timeout (0:00:01)!")
    assert "shutdown still waits on" in waiting and "stuck_await" in waiting, done.stderr
    assert "stuck_thread" in threads, done.stderr


def test_a_shutdown_that_ends_in_time_is_left_alone() -> None:
    script = "from common import service\nservice.bound_shutdown(5.0)\nprint('clean')\n"
    done = _run(script)
    assert (done.returncode, done.stdout.strip()) == (0, "clean"), done.stderr


async def test_a_burst_of_calls_while_the_loop_is_busy_is_served_not_cancelled() -> None:
    """More calls at once than grpc's core queues by default (1,000) for a server whose event loop
    takes them slowly: every one is served (a tenth came back CANCELLED)."""
    server = service.make_server(1 << 20)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def busy_loop() -> None:  # a loop that takes up calls slowly, as under a flood of submits
        while True:
            started = time.perf_counter()
            while time.perf_counter() - started < 0.05:
                pass
            await asyncio.sleep(0.01)

    busy = asyncio.create_task(busy_loop())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def check() -> str:
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=120)
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name
                return "OK"

            outcomes = await asyncio.gather(*(check() for _ in range(2000)))
    finally:
        busy.cancel()
        await server.stop(0)
    assert collections.Counter(outcomes) == {"OK": 2000}

"""The entrypoints' shared shutdown: a graceful stop that hangs ends anyway, saying where it hung."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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

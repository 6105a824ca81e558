"""``baton dev``: redis-server, a scheduler and an executor on this machine, in one command.

Each service runs as its own process, as in production; Ctrl-C stops all of them. An executor that
exits (killed, or its engine failed: it then exits with status 1 once its requests are re-queued)
is started again under the same id, as compose's restart policy does, up to ``EXECUTOR_RESTARTS``
times in all; a crash loop, or Redis or the scheduler exiting, stops the whole stack.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from baton.make_model import make_model

log = logging.getLogger(__name__)

EXECUTOR_RESTARTS = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise ValueError("redis-server is not installed; install it or pass --redis-url")
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(workdir),
            "--appendonly",
            "yes",
            "--save",
            "",
        ],
        stdout=subprocess.DEVNULL,
    )
    return proc, f"redis://127.0.0.1:{port}/0"


def wait_healthy(target: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    from baton.client_commands import health

    args = argparse.Namespace(target=target, service="", timeout=1.0)
    deadline = time.monotonic() + timeout_s
    with open(os.devnull, "w") as quiet:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"service for {target} exited with {proc.returncode}")
            saved, sys.stdout, sys.stderr = (sys.stdout, sys.stderr), quiet, quiet
            try:
                ok = health(args) == 0
            finally:
                sys.stdout, sys.stderr = saved
            if ok:
                return
            time.sleep(0.3)
    raise RuntimeError(f"{target} did not become healthy in {timeout_s:.0f} s")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the whole stack, like Ctrl-C


def run(args: argparse.Namespace) -> int:
    if args.executors < 1:
        raise SystemExit(f"baton dev: --executors must be at least 1, got {args.executors}")
    signal.signal(signal.SIGTERM, _interrupt)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s baton dev: %(message)s")
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model:
        model = str(workdir / "tiny-model")
        if not (Path(model) / "config.json").exists():
            log.info("generating the tiny model into %s", model)
            make_model(model, size="tiny", seed=0, progress=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        redis_url = args.redis_url
        if not redis_url:
            redis_proc, redis_url = start_redis(workdir)
            procs.append(redis_proc)
        config = ["--config", args.config] if args.config else []
        baton = [sys.executable, "-m", "baton.cli"]
        executors: dict[int, list[str]] = {}  # position in ``procs`` -> its command, to start it again
        for number in range(1, args.executors + 1):
            executor_port = free_port()
            # A fixed id per executor: one started again in its place takes over its records (the new
            # link re-queues what Redis says ran there) instead of sharing its port under a new id.
            executor_id = f"dev-executor-{number}"
            executor_args = ["--model", model, "--host", "127.0.0.1", "--port", str(executor_port), *config]
            command = [*baton, "executor", "--redis-url", redis_url, "--executor-id", executor_id, *executor_args]
            executors[len(procs)] = command
            procs.append(subprocess.Popen(command))
            wait_healthy(f"127.0.0.1:{executor_port}", procs[-1], 300)
        scheduler_args = ["--host", "127.0.0.1", "--port", str(args.port), *config]  # loopback, as everything here
        scheduler = subprocess.Popen([*baton, "scheduler", "--redis-url", redis_url, *scheduler_args])
        procs.append(scheduler)
        wait_healthy(f"127.0.0.1:{args.port}", scheduler, 60)
        log.info(
            'ready: baton generate "Hello" --target 127.0.0.1:%d   (Redis at %s; Ctrl-C stops)', args.port, redis_url
        )
        return supervise(procs, executors)
    except KeyboardInterrupt:
        log.info("stopping")
        return 0
    finally:
        stop_unrecorded_children(procs)
        stop_processes(procs)


def supervise(procs: list[subprocess.Popen[bytes]], executors: dict[int, list[str]]) -> int:
    """Until a service other than an executor exits (then 1): start each executor that exits again,
    up to ``EXECUTOR_RESTARTS`` times in all. ``executors``: their positions in ``procs`` and commands."""
    restarts = 0
    while True:
        for position, proc in enumerate(procs):
            if proc.poll() is None:
                continue
            if position not in executors or restarts >= EXECUTOR_RESTARTS:
                log.error("a service exited with %s; stopping the rest", proc.returncode)
                return 1
            restarts += 1
            log.warning(
                "an executor exited with %s; starting it again (%d of %d)", proc.returncode, restarts, EXECUTOR_RESTARTS
            )
            procs[position] = subprocess.Popen(executors[position])
        time.sleep(0.5)


def stop_unrecorded_children(procs: list[subprocess.Popen[bytes]], timeout_s: float = 15) -> None:
    """Stop the children of this process that ``procs`` does not hold: one a Ctrl-C caught between
    its ``Popen`` and the list (a restart, a start) would otherwise outlive ``baton dev``. First, so
    that such an executor still has Redis while it stops."""
    recorded = {proc.pid for proc in procs}
    strays = [child for child in psutil.Process().children() if child.pid not in recorded]
    for child in strays:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(strays, timeout=timeout_s)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout_s: float = 15) -> None:
    """SIGTERM in reverse start order (clients of a service stop before it), then kill stragglers."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

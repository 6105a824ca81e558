"""A throwaway Baton for benchmarks: redis-server, executors (one by default) and a scheduler, each its own process.

As ``baton dev`` starts them, on free loopback ports, with settings passed as ``BATON_*`` environment
overrides. Used by ``baton bench --local`` and by the comparison scripts under ``bench/``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from baton.dev import free_port, start_redis, stop_processes, wait_healthy
from baton.make_model import make_model

log = logging.getLogger(__name__)


@dataclass
class LocalStack:
    """Handles of a started stack."""

    target: str  # the scheduler's HOST:PORT
    redis_url: str
    pids: dict[str, int]  # redis, executor (then executor-2, executor-3, ...), scheduler
    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds each process has used so far."""
        return {name: sum(psutil.Process(pid).cpu_times()[:2]) for name, pid in self.pids.items()}


def ensure_model(workdir: Path, size: str = "tiny", progress: bool = False) -> Path:
    """The generated model of ``size`` (seed 0) under ``workdir``, made once and reused."""
    model_dir = workdir / f"model-{size}"
    if not (model_dir / "config.json").exists():
        make_model(model_dir, size=size, seed=0, progress=progress)
    return model_dir


def executor_name(number: int) -> str:
    """The key of the ``number``-th executor (from 1) in ``LocalStack.pids``, and its log's name."""
    return "executor" if number == 1 else f"executor-{number}"


def _spawn(cmd: list[str], log_path: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(env))


@contextlib.contextmanager
def local_stack(
    model_dir: Path,
    logs: Path,
    overrides: Mapping[str, str] | None = None,
    config: str | None = None,
    executors: int = 1,
) -> Iterator[LocalStack]:
    """Start the stack, yield it once the scheduler is healthy, stop every process on exit.

    ``overrides``: extra environment for both services, e.g. ``{"BATON_EXECUTOR__DTYPE": "bfloat16"}``.
    ``executors``: how many executor processes serve the model (each its own weights and KV cache).
    """
    if executors < 1:
        raise ValueError(f"executors must be >= 1, got {executors}")
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(overrides or {})}
    baton = [sys.executable, "-m", "baton.cli"]
    extra = ["--config", config] if config else []
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="redis-", dir=logs) as redis_dir:
        try:
            redis_proc, redis_url = start_redis(Path(redis_dir))
            procs.append(redis_proc)
            pids = {"redis": redis_proc.pid}
            log.info("starting %d executor(s) on %s and a scheduler (logs in %s)", executors, model_dir, logs)
            for number in range(1, executors + 1):
                name = executor_name(number)
                ex_port = free_port()
                ex_args = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(ex_port), *extra]
                cmd = [*baton, "executor", "--redis-url", redis_url, *ex_args]
                procs.append(_spawn(cmd, logs / f"{name}.log", env))
                wait_healthy(f"127.0.0.1:{ex_port}", procs[-1], 300)
                pids[name] = procs[-1].pid
            sched_port = free_port()
            sched_args = ["--redis-url", redis_url, "--host", "127.0.0.1", "--port", str(sched_port), *extra]
            procs.append(_spawn([*baton, "scheduler", *sched_args], logs / "scheduler.log", env))
            wait_healthy(f"127.0.0.1:{sched_port}", procs[-1], 60)
            pids["scheduler"] = procs[-1].pid
            yield LocalStack(f"127.0.0.1:{sched_port}", redis_url, pids, logs, procs)
        finally:
            stop_processes(procs)

"""Baton as separate processes (redis-server, executors, schedulers), for tests that kill them."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import free_port


def is_serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _redis_args(port: int, data_dir: Path) -> list[str]:
    return [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
        "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
    ]  # fmt: skip


def _wait_pong(port: int, timeout: float = 10.0) -> None:
    """Until Redis answers PONG: a server still replaying its AOF answers LOADING instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True).stdout.strip() == b"PONG":
            return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not start")


@dataclass
class ProcessStack:
    workdir: Path
    model_dir: Path
    redis_port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def write_config(self) -> Path:
        config = {
            "distributed": {
                "redis_url": self.redis_url,
                "heartbeat_interval_ms": 200,
                "lease_ttl_ms": 1000,
                "executor_timeout_ms": 1000,
                "discovery_interval_ms": 100,
                "redis_retry_s": 60,
            },
            # One torch thread, as OMP_NUM_THREADS below: several services share CI's two cores.
            "executor": {
                "model": str(self.model_dir),
                "host": "127.0.0.1",
                "kv_cache_memory_mb": 64,
                "torch_threads": 1,
            },
            "scheduler": {"host": "127.0.0.1"},
            "monitoring": {"log_level": "INFO"},
        }
        path = self.workdir / "baton.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def start_redis(self) -> None:
        """Redis as docker-compose runs it (AOF, fsync every second); again after a stop or a
        kill, it replays what its data directory holds."""
        self._spawn("redis", _redis_args(self.redis_port, self.workdir))
        _wait_pong(self.redis_port)

    @contextmanager
    def replayed(self) -> Iterator[redis.Redis]:
        """A client of a throwaway Redis that replayed a copy of the data directory: what the real
        one will load when restarted, seen before any service can write to it. Redis must be down."""
        copy = self.workdir / "replayed"
        shutil.rmtree(copy, ignore_errors=True)
        copy.mkdir()
        for name in ("appendonlydir", "appendonly.aof"):
            if (self.workdir / name).is_dir():
                shutil.copytree(self.workdir / name, copy / name)
            elif (self.workdir / name).exists():
                shutil.copy(self.workdir / name, copy / name)
        port = free_port()
        log = open(self.workdir / "replayed.log", "ab")  # noqa: SIM115 - the process owns it
        proc = subprocess.Popen(_redis_args(port, copy), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_pong(port)
            with redis.Redis(port=port, decode_responses=True) as client:
                yield client
        finally:
            proc.kill()
            proc.wait(timeout=10)

    def start_executor(self, executor_id: str) -> str:
        port = free_port()
        baton = [sys.executable, "-m", "baton.cli"]
        config = str(self.write_config())
        self._spawn(
            executor_id, [*baton, "executor", "--config", config, "--port", str(port), "--executor-id", executor_id]
        )
        target = f"127.0.0.1:{port}"
        self.wait_healthy(executor_id, target, 120)
        return target

    def start_scheduler(self, name: str) -> str:
        port = free_port()
        config = str(self.write_config())
        self._spawn(name, [sys.executable, "-m", "baton.cli", "scheduler", "--config", config, "--port", str(port)])
        target = f"127.0.0.1:{port}"
        self.wait_healthy(name, target, 60)
        return target

    def wait_healthy(self, name: str, target: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited: {(self.workdir / f'{name}.log').read_text()[-2000:]}")
            if is_serving(target):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not become healthy")

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self, name: str) -> int:
        """SIGTERM, and SIGKILL if the process is still there after 30 s; its exit code."""
        proc = self.procs.pop(name)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            raise
        return proc.returncode

    def stop_all(self) -> None:
        """Stop everything still running. A service whose graceful shutdown hung (it then dumps its
        threads' stacks into its log and exits non-zero) is a warning with that log's tail: the
        test's own result stands, and the hang is there to read."""
        for name in list(self.procs):
            try:
                returncode = self.stop(name)
            except subprocess.TimeoutExpired:
                warnings.warn(f"{name} ignored SIGTERM for 30 s:\n{self.log(name)[-6000:]}", stacklevel=2)
                continue
            if name != "redis" and returncode not in (0, -signal.SIGTERM):
                warnings.warn(f"{name} exited {returncode} on SIGTERM:\n{self.log(name)[-6000:]}", stacklevel=2)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def replica_id(self, name: str) -> str:
        """The replica id a started scheduler took: what it writes into the executor leases it holds."""
        found = re.search(r"scheduler (\S+) listening on port", self.log(name))
        if found is None:
            raise RuntimeError(f"{name} logged no replica id: {self.log(name)[-2000:]}")
        return found.group(1)

    def aof_tail(self) -> tuple[Path, int]:
        """The AOF file Redis appends to now, and its size: a point to cut it back to after a kill.

        Cutting it there is what an ``appendfsync everysec`` Redis on a crashed host recovers: a
        prefix of what it acknowledged. Redis 7 appends to the last ``type i`` file of its
        manifest; older versions to one ``appendonly.aof``.
        """
        manifest = self.workdir / "appendonlydir" / "appendonly.aof.manifest"
        if not manifest.exists():
            path = self.workdir / "appendonly.aof"
            return path, path.stat().st_size
        increments = [line.split()[1] for line in manifest.read_text().splitlines() if line.endswith(" type i")]
        if not increments:
            raise RuntimeError(f"no incremental AOF in {manifest}: {manifest.read_text()}")
        path = manifest.parent / increments[-1]
        return path, path.stat().st_size

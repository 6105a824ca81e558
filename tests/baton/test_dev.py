"""``baton dev`` as a process: its stack serves, and an executor that dies is started again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import yaml

from common.pb import generate_pb2 as pb
from common.pb import generate_pb2_grpc
from tests.conftest import free_port
from tests.process_stack import is_serving
from tests.scheduler_service.test_end_to_end import greedy, random_prompts


def _executors(dev: subprocess.Popen[bytes]) -> list[psutil.Process]:
    return [child for child in psutil.Process(dev.pid).children() if "executor" in child.cmdline()]


def _generate(target: str, tokens: int, timeout: float) -> int:
    """Output tokens of one greedy request, retrying while the stack has no executor to run it."""
    request = greedy(random_prompts(1, seed=51)[0], tokens)
    deadline = time.monotonic() + timeout
    while True:
        with grpc.insecure_channel(target) as channel:
            try:
                chunks = list(generate_pb2_grpc.GenerationStub(channel).Generate(request))
                return sum(len(chunk.token_ids) for chunk in chunks)
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.5)


def test_an_executor_that_dies_is_started_again(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = tmp_path / "baton.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "distributed": {
                    "heartbeat_interval_ms": 200,
                    "lease_ttl_ms": 1000,
                    "executor_timeout_ms": 1000,
                    "discovery_interval_ms": 100,
                },
                "executor": {"kv_cache_memory_mb": 64, "torch_threads": 1},
            }
        )
    )
    port = free_port()
    command = [sys.executable, "-m", "baton.cli", "dev", "--model", str(tiny_model_dir), "--port", str(port)]
    log = open(tmp_path / "dev.log", "wb")  # noqa: SIM115 - the process owns it
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    dev = subprocess.Popen(
        [*command, "--workdir", str(tmp_path / "dev"), "--config", str(config)], stdout=log, stderr=log, env=env
    )
    target = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not is_serving(target):
            assert dev.poll() is None and time.monotonic() < deadline, (tmp_path / "dev.log").read_text()[-3000:]
            time.sleep(0.2)
        assert _generate(target, 8, 60) == 8
        (victim,) = _executors(dev)
        with grpc.insecure_channel(target) as channel:
            # A stream that is running when its executor dies, and ends on the one started in its place.
            stream = generate_pb2_grpc.GenerationStub(channel).Generate(greedy(random_prompts(1, seed=52)[0], 600))
            received = 0
            for chunk in stream:
                assert chunk.index == received, "a gap or a repeat in the stream"
                received += len(chunk.token_ids)
                if received >= 20 and victim.is_running():
                    victim.kill()
                    victim.wait(30)
        assert received == 600 and chunk.finish_reason == pb.FINISH_REASON_LENGTH
        assert _generate(target, 8, 120) == 8
        assert dev.poll() is None, "baton dev stopped when its executor died"
        (successor,) = _executors(dev)
        assert successor.pid != victim.pid
        assert "dev-executor-1" in successor.cmdline()  # the same id: it takes over the dead one's records
    finally:
        dev.send_signal(signal.SIGTERM)
        returncode = dev.wait(60)
        log.close()
    assert returncode == 0, (tmp_path / "dev.log").read_text()[-3000:]


# A process that starts a child it never records, as a Ctrl-C between a Popen and its list would
# leave it, then stops what baton dev would stop on its way out; it prints the child's pid.
_STRAY = """
import subprocess, sys
from baton.dev import stop_processes, stop_unrecorded_children
recorded = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(stray.pid, flush=True)
stop_unrecorded_children(recorded)
stop_processes(recorded)
"""


def test_a_child_started_but_never_recorded_is_stopped_too() -> None:
    done = subprocess.run([sys.executable, "-c", _STRAY], capture_output=True, timeout=60, text=True)
    assert done.returncode == 0, done.stderr
    stray = int(done.stdout.split()[0])
    assert not psutil.pid_exists(stray) or psutil.Process(stray).status() == psutil.STATUS_ZOMBIE

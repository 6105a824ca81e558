"""``local_stack``: the benchmarks' throwaway stack, with more than one executor process."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import psutil
import pytest
import redis

from baton.bench.client import RunPlan, run_workload
from baton.bench.local_stack import executor_name, local_stack
from baton.bench.workload import WorkloadSpec


def test_two_executor_processes_share_the_work(tiny_model_dir: Path, tmp_path: Path) -> None:
    with local_stack(tiny_model_dir, tmp_path / "logs", {"BATON_EXECUTOR__NICE": "5"}, executors=2) as stack:
        assert [name for name in stack.pids if name.startswith("executor")] == ["executor", "executor-2"]
        store = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        assert store.zcard("{baton}:executors") == 2
        deadline = time.monotonic() + 60
        while len(list(store.scan_iter("{baton}:lease:executor:*"))) < 2:  # the scheduler drives both
            assert time.monotonic() < deadline, "the scheduler did not take both executors' leases"
            time.sleep(0.1)
        specs = WorkloadSpec(8, (4, 24), (3, 6), seed=1).build()
        timings, _ = asyncio.run(run_workload(stack.target, specs, RunPlan(max_concurrency=8)))
        for spec, timing in zip(specs, timings, strict=True):
            assert timing.ok, timing.error
            assert timing.output_len == spec.output_len
        request_keys = [key for key in store.scan_iter("{baton}:req:*") if key.count(":") == 2]  # not :tokens
        served_by = {key: store.hget(key, "executor") for key in request_keys}
        assert len(served_by) == len(specs) + 1  # and the warm-up request
        assert len(set(served_by.values())) == 2, "placement by free KV room spreads the requests over both"
        names = (executor_name(1), executor_name(2), "scheduler")
        logs = {name: (tmp_path / "logs" / f"{name}.log").read_text() for name in names}
        # Each service's entry point takes its startup heap out of the collector's full passes.
        assert all("startup objects out of the garbage collector" in text for text in logs.values())
        # The scheduler loads the tokenizer with the first request, and freezes again after it.
        assert logs["scheduler"].count("startup objects out of the garbage collector") == 2
        # Every executor thread (torch's, gRPC's, asyncio's) runs at the nice value asked for.
        own = os.getpriority(os.PRIO_PROCESS, 0)
        for name in names:
            nices = {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(stack.pids[name]).threads()}
            assert nices == ({own} if name == "scheduler" else {max(own, 5)}), name


def test_at_least_one_executor(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="executors"), local_stack(tiny_model_dir, tmp_path, executors=0):
        pass

"""bench/throughput.py's phase (b): Baton's engine loop in process, with no scheduler, Redis or gRPC.

With ``Setup.engine_processes`` N > 1 the workload is dealt round-robin to N processes, each with
its own engine (as N executors each have their own); they start together and the phase ends when
the last one finishes. That is the baseline to hold an end-to-end run with N executors against.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from queue import Queue
from typing import Any

import torch
from tqdm import tqdm

from bench.device_watch import DeviceWatch, sampler_reader
from bench.throughput_setup import MAX_BATCH, WARM_PROMPT, WARM_TOKENS, Result, Setup, Workload, finish, progress, say
from common.config import ExecutorConfig
from common.sampling_params import SamplingParams
from executor_service.cpu_threads import prefer_brief_openmp_spin
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, PlanUpdate
from executor_service.model_loader import load_engine

LABEL = "(b) Baton engine in process"


def engine_round(
    engine: Engine, prompts: list[list[int]], max_tokens: list[int], bar: tqdm | None, max_batch: int = MAX_BATCH
) -> list[list[int]]:
    """Admit up to ``max_batch`` at a time (more as others finish); step until all finish."""
    pending = [
        AdmitSpec(f"r{engine.plan_seq}-{i}", tuple(p), (), SamplingParams(max_tokens=n, ignore_eos=True), float(i))
        for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    ids = [spec.request_id for spec in pending]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    done = 0
    while done < len(ids):
        room = max_batch - len(engine.running)
        if pending and room > 0:
            engine.apply(PlanUpdate(seq=engine.plan_seq + 1, admit=tuple(pending[:room])))
            del pending[:room]
        out = engine.step() if engine.has_work else engine.drain()
        if out.preempted or out.rejected or any(f.error for f in out.finished):
            raise RuntimeError(f"engine preempted/rejected/failed requests: {out}")
        for delta in out.tokens:
            outputs[delta.request_id].extend(delta.token_ids)
        done += len(out.finished)
        if bar is not None:
            bar.update(len(out.finished))
    return [outputs[rid] for rid in ids]


def _load(model_dir: Path, kv_mb: int, setup: Setup) -> Engine:
    config = ExecutorConfig(
        model=str(model_dir),
        kv_cache_memory_mb=kv_mb,
        max_batch_size=setup.max_batch,
        token_budget=setup.token_budget,
        device=str(setup.torch_device),
        dtype=setup.dtype,
        torch_threads=setup.executor_threads,
        cuda_graphs=setup.cuda_graphs,
        async_scheduling=setup.async_scheduling,
        block_size=setup.block_size,
    )
    engine = load_engine(config).engine  # sets this process's torch threads as the executor would
    engine_round(engine, [WARM_PROMPT], [WARM_TOKENS], None, setup.max_batch)
    return engine


def _warm(engine: Engine, wl: Workload, setup: Setup) -> None:
    if setup.warm_workload:
        engine_round(engine, wl.prompts, wl.max_tokens, None, setup.max_batch)


def _threads_note(engine: Engine) -> str:
    governor = engine.threads
    if governor is None:
        return f"torch threads {torch.get_num_threads()}"
    return f"torch threads {governor.few} for light steps, {governor.many} for heavy ones (the executor default)"


def run_engine(model_dir: Path, wl: Workload, kv_mb: int, setup: Setup | None = None) -> Result:
    setup = setup or Setup()
    if setup.engine_processes < 1:
        raise ValueError("engine_processes must be at least 1")
    if setup.engine_processes > 1:
        return run_engine_processes(model_dir, wl, kv_mb, setup)
    hf_threads = torch.get_num_threads()
    engine = _load(model_dir, kv_mb, setup)
    _warm(engine, wl, setup)
    with (
        progress(len(wl.prompts), LABEL) as bar,
        DeviceWatch(sampler_reader(str(setup.torch_device)) if setup.watch_device else None) as watch,
    ):
        cpu, started = time.process_time(), time.perf_counter()
        outputs = engine_round(engine, wl.prompts, wl.max_tokens, bar, setup.max_batch)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    note = f"{_threads_note(engine)}; {cpu:.1f} CPU seconds"
    torch.set_num_threads(hf_threads)  # (c) and (d) get the machine's default, as they would alone
    result = finish(LABEL, seconds, outputs, wl, sum(map(len, outputs)), note)
    result.device_load = watch.summary()
    return result


def _engine_worker(
    shard: int, model_dir: Path, wl: Workload, kv_mb: int, setup: Setup, ready: Queue[Any], go: Event, done: Queue[Any]
) -> None:
    engine = _load(model_dir, kv_mb, setup)
    _warm(engine, wl, setup)
    ready.put(shard)
    go.wait()
    cpu = time.process_time()
    outputs = engine_round(engine, wl.prompts, wl.max_tokens, None, setup.max_batch)
    done.put((shard, time.monotonic(), outputs, _threads_note(engine), time.process_time() - cpu))


def run_engine_processes(model_dir: Path, wl: Workload, kv_mb: int, setup: Setup) -> Result:
    """The workload dealt to ``setup.engine_processes`` engine processes, timed from a common start."""
    count = setup.engine_processes
    shards = [list(range(i, len(wl.prompts), count)) for i in range(count)]
    ctx = mp.get_context("spawn")  # a fresh interpreter each: no forked OpenMP state
    ready, done, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = []
    # Each child loads libgomp with the policy an executor process gets (PASSIVE: idle OpenMP
    # workers sleep). Spinning workers of N processes on shared cores would wait on each other.
    saved = dict(os.environ)
    prefer_brief_openmp_spin()
    try:
        for i, shard in enumerate(shards):
            part = Workload([wl.prompts[j] for j in shard], [wl.max_tokens[j] for j in shard])
            proc = ctx.Process(target=_engine_worker, args=(i, model_dir, part, kv_mb, setup, ready, go, done))
            proc.start()
            procs.append(proc)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        for _ in procs:
            ready.get(timeout=900)
        say(f"{LABEL}: {count} engine processes loaded and warm; running")
        started = time.monotonic()
        go.set()
        finished = [done.get(timeout=3600) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    outputs: list[list[int]] = [[] for _ in wl.prompts]
    for shard, _, shard_outputs, _, _ in finished:
        for j, out in zip(shards[shard], shard_outputs, strict=True):
            outputs[j] = out
    seconds = max(at for _, at, _, _, _ in finished) - started
    cpu = " ".join(f"{f[4]:.1f}" for f in sorted(finished))
    note = f"{count} engine processes, the workload dealt round-robin, CPU seconds {cpu}; each: {finished[0][3]}"
    return finish(f"(b) Baton engine x{count} processes", seconds, outputs, wl, sum(map(len, outputs)), note)

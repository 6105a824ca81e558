"""bench/throughput.py's phase (a): Baton end to end, a local stack driven by concurrent gRPC ``Generate`` streams.

Also the driver ``bench/vllm_compare.py`` runs against the same stack.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
import psutil
from tqdm import tqdm

from baton.bench.local_stack import local_stack
from baton.dev import free_port
from bench.device_watch import DeviceWatch, metrics_reader
from bench.throughput_setup import WARM_PROMPT, WARM_TOKENS, Result, Setup, Workload, finish, progress, say
from common.pb import generate_pb2 as pb
from common.pb.generate_pb2_grpc import GenerationStub

# ---- (a) Baton end to end ------------------------------------------------------------------
RPCS = ("generate", "batch")  # a Generate stream per request, or the workload over one GenerateBatch


def stack_env(setup: Setup, kv_mb: int, metrics_port: int) -> dict[str, str]:
    env = dict(os.environ, BATON_EXECUTOR__KV_CACHE_MEMORY_MB=str(kv_mb))
    env["BATON_EXECUTOR__TORCH_THREADS"] = str(setup.executor_threads)
    env["BATON_EXECUTOR__DEVICE"] = str(setup.torch_device)
    env["BATON_EXECUTOR__DTYPE"] = setup.dtype
    env["BATON_EXECUTOR__MAX_BATCH_SIZE"] = str(setup.max_batch)
    env["BATON_EXECUTOR__TOKEN_BUDGET"] = str(setup.token_budget)
    env["BATON_SCHEDULER__BATCH_LEVEL__MAX_BATCH_SIZE"] = str(setup.max_batch)
    env["BATON_SCHEDULER__TOKEN_LEVEL__TOKEN_BUDGET"] = str(setup.token_budget)
    env["BATON_MONITORING__EXECUTOR_METRICS_PORT"] = str(metrics_port)
    env["BATON_DISTRIBUTED__STREAM_INTERVAL_TOKENS"] = str(setup.stream_interval)
    env["BATON_EXECUTOR__REPORT_EVERY_STEPS"] = str(setup.report_every_steps)
    env["BATON_EXECUTOR__CUDA_GRAPHS"] = "true" if setup.cuda_graphs else "false"
    env["BATON_EXECUTOR__ASYNC_SCHEDULING"] = setup.async_scheduling
    env["BATON_EXECUTOR__BLOCK_SIZE"] = str(setup.block_size)
    return env


def run_baton_e2e(model_dir: Path, wl: Workload, kv_mb: int, logs: Path, setup: Setup | None = None) -> Result:
    setup = setup or Setup()
    metrics_port = free_port() if setup.watch_device else 0
    say(f"(a) starting executor and scheduler (logs in {logs})")
    env = stack_env(setup, kv_mb, metrics_port)
    with local_stack(model_dir, logs, overrides=env, executors=setup.executors) as stack:
        with DeviceWatch(metrics_reader(metrics_port) if metrics_port else None) as watch:
            pids = stack.pids | {"client": os.getpid()}
            result = asyncio.run(
                drive_grpc(stack.target, wl, pids, setup.rpc, setup.request_chunk, warm_workload=setup.warm_workload)
            )
        result.device_load = watch.summary()
        return result


def params_pb(max_tokens: int, chunk: int = 0) -> pb.SamplingParams:
    """Greedy to exactly ``max_tokens``; ``chunk``: the request's own stream interval (0: none)."""
    return pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, stream_interval_tokens=chunk)


async def stream_one(
    stub: GenerationStub, prompt: list[int], max_tokens: int, bar: tqdm | None = None, chunk: int = 0
) -> list[int]:
    params = params_pb(max_tokens, chunk)
    tokens: list[int] = []
    async for response in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, params=params)):
        tokens.extend(response.token_ids)
    if bar is not None:
        bar.update()
    return tokens


async def stream_batch(stub: GenerationStub, wl: Workload, bar: tqdm | None = None, chunk: int = 0) -> list[list[int]]:
    """The whole workload over one GenerateBatch stream: each message carries every request's news."""
    requests = [
        pb.GenerateRequest(prompt_token_ids=prompt, params=params_pb(n, chunk))
        for prompt, n in zip(wl.prompts, wl.max_tokens, strict=True)
    ]
    outputs: list[list[int]] = [[] for _ in requests]
    async for message in stub.GenerateBatch(iter(requests)):
        for event in message.events:
            if event.error_code:
                raise RuntimeError(f"request {event.position} failed: {event.error_message}")
            outputs[event.position].extend(event.response.token_ids)
            if event.response.finish_reason and bar is not None:
                bar.update()
    return outputs


async def _send_workload(
    stub: GenerationStub, wl: Workload, rpc: str, chunk: int, bar: tqdm | None = None
) -> list[list[int]]:
    if rpc == "batch":
        return await stream_batch(stub, wl, bar, chunk)
    jobs = (stream_one(stub, p, n, bar, chunk) for p, n in zip(wl.prompts, wl.max_tokens, strict=True))
    return list(await asyncio.gather(*jobs))


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    return {name: sum(psutil.Process(pid).cpu_times()[:2]) for name, pid in pids.items()}


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of each of ``pid``'s threads, by thread id ({} once the process is gone)."""
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}
    except psutil.Error:
        return {}


def thread_split(pid: int, before: dict[int, float], after: dict[int, float]) -> str:
    """ "main 0.4, then 1.3 0.9": the main thread's CPU in the window (the executor's asyncio and gRPC
    service work), then its busiest other threads (the engine thread and torch's workers)."""
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    others = sorted((v for tid, v in used.items() if tid != pid and v >= 0.05), reverse=True)
    return f"main {used.get(pid, 0.0):.1f}, then " + " ".join(f"{v:.1f}" for v in others[:3])


def cpu_wait_seconds(pids: list[int]) -> float | None:
    """Seconds the processes' threads spent runnable but waiting for a core (Linux schedstat).

    Thread CPU time cannot tell an engine step that was preempted by the other processes from
    one that waited on its own GIL; this can: it counts only the time in the run queue.
    """
    total = 0
    try:
        for pid in pids:
            for task in Path(f"/proc/{pid}/task").iterdir():
                total += int((task / "schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None  # not Linux, or no schedstat in this kernel
    return total / 1e9


async def drive_grpc(
    target: str, wl: Workload, pids: dict[str, int], rpc: str = "generate", chunk: int = 0, warm_workload: bool = False
) -> Result:
    """The workload through ``rpc``: "generate" (a stream per request) or "batch" (one GenerateBatch);
    ``chunk``: each request's own ``stream_interval_tokens``; ``warm_workload``: run the workload once,
    untimed, first."""
    if rpc not in RPCS:
        raise ValueError(f"rpc must be one of {RPCS}, not {rpc!r}")
    executors = [pid for name, pid in pids.items() if name.startswith("executor")]
    async with grpc.aio.insecure_channel(target) as channel:
        stub = GenerationStub(channel)
        deadline = time.monotonic() + 60
        while True:  # warm-up; UNAVAILABLE until the scheduler has attached the executor
            try:
                await stream_one(stub, WARM_PROMPT, WARM_TOKENS)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        if warm_workload:
            say(f"(a) warm-up: the workload once over {rpc}, untimed")
            await _send_workload(stub, wl, rpc, chunk)
        with progress(len(wl.prompts), f"(a) Baton end to end over gRPC ({rpc})") as bar:
            wait_before = cpu_wait_seconds(executors)
            threads_before = {pid: thread_cpu_seconds(pid) for pid in executors}
            cpu_before, started = cpu_seconds(pids), time.perf_counter()
            outputs = await _send_workload(stub, wl, rpc, chunk, bar)
            seconds, cpu_after = time.perf_counter() - started, cpu_seconds(pids)
            wait_after = cpu_wait_seconds(executors)
            threads = [thread_split(pid, threads_before[pid], thread_cpu_seconds(pid)) for pid in executors]
    used = ", ".join(f"{name} {cpu_after[name] - cpu_before[name]:.1f}" for name in pids)
    note = f"CPU seconds used in the {seconds:.1f} s window ({os.cpu_count()} cores): {used}"
    if wait_before is not None and wait_after is not None:
        whose = "executor's" if len(executors) == 1 else f"{len(executors)} executors'"
        note += f"; the {whose} threads waited {wait_after - wait_before:.2f} s for a core"
    if any(threads):
        note += "; executor threads: " + " | ".join(threads)
    label = "(a) Baton end to end (gRPC)" if rpc == "generate" else "(a) Baton end to end (GenerateBatch)"
    return finish(label, seconds, outputs, wl, sum(map(len, outputs)), note)

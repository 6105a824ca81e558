"""Output-token throughput of Baton against plain transformers, on one fixed workload.

Same requests (default 64: prompts of 32-256 random ids starting with BOS, outputs of 16-128
tokens, greedy, EOS ignored) and same generated model (float32 on CPU by default) in every
phase: (a) Baton end to end, redis-server + executor + scheduler processes, gRPC Generate
streams; (b) Baton's engine loop in process; (c) HF ``generate`` in static batches of 16 (left
padding); (d) transformers' continuous batching, ``generate_batch``. tok/s = tokens the requests
asked for / seconds from the first submit to the last finish; padding tokens that (c) and (d)
compute are not counted. On a GPU (``--device cuda --dtype bfloat16 --sizes 1b``) phases (a) and
(b) also report the device load (NVML) sampled during their window.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
import torch
import transformers
from device_watch import DeviceWatch, metrics_reader, sampler_reader
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig

from baton.bench.local_stack import local_stack
from baton.dev import _free_port
from baton.make_model import SIZES, make_model
from common.config import ExecutorConfig
from common.pb import generate_pb2 as pb
from common.pb.generate_pb2_grpc import GenerationStub
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, PlanUpdate
from executor_service.model_loader import load_engine
from executor_service.sampling import SamplingParams

BOS, MAX_BATCH, STATIC_BATCH, BLOCK = 1, 64, 16, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARM_PROMPT, WARM_TOKENS = [BOS, 5, 6, 7, 8, 9, 10, 11], 4
TARGETS = {"a/b": 0.95, "a/c": 3.0}


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]


@dataclass(frozen=True)
class Setup:
    """How every phase runs: the same device, dtype, batch and budget for Baton and for HF."""

    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = MAX_BATCH
    token_budget: int = 512
    kv_mb: int = 0  # 0: sized from the workload (kv_memory_mb)
    executor_threads: int = 0  # Baton's torch threads in (a) and (b); 0: the executor's own choice
    stream_interval: int = 1  # (a): tokens a request gathers before the scheduler writes them

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda" if self.device == "auto" and torch.cuda.is_available() else self.device)

    @property
    def watch_device(self) -> bool:
        """Sample NVML during (a) and (b): on a GPU only, since on CPU the sampling itself takes CPU."""
        return self.torch_device.type == "cuda"


@dataclass
class Result:
    label: str
    tok_s: float | None = None
    seconds: float = 0.0
    useful_tokens: int = 0  # tokens the requests asked for (and got)
    computed_tokens: int = 0  # tokens the phase generated, padding included
    note: str = ""
    load: float = 0.0  # 1-minute load average as the phase ended: other work on the machine skews results
    outputs: list[list[int]] | None = None
    device_load: dict[str, float] | None = None  # NVML (or process) figures sampled in the window


def make_workload(count: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(count):
        length = rng.randint(32, 256)
        prompts.append([BOS] + [rng.randrange(5, 8000) for _ in range(length - 1)])
        outs.append(rng.randint(16, 128))
    return Workload(prompts, outs)


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def progress(total: int, desc: str) -> tqdm:
    say(desc)
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)


def kv_memory_mb(model_dir: Path, wl: Workload) -> int:
    """Enough KV cache (in the model's dtype) for every request at full length at once, plus a quarter."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    element = DTYPES[cfg.get("dtype") or cfg.get("torch_dtype") or "float32"].itemsize
    per_token = 2 * cfg["num_hidden_layers"] * (cfg.get("num_key_value_heads") or heads) * head_dim * element
    tokens = sum(-(-(len(p) + n + 1) // BLOCK) * BLOCK for p, n in zip(wl.prompts, wl.max_tokens, strict=True))
    return max(256, 256 * math.ceil(tokens * per_token * 1.25 / 2**20 / 256))


def finish(label: str, seconds: float, outputs: list[list[int]], wl: Workload, computed: int, note: str) -> Result:
    useful = sum(min(len(o), n) for o, n in zip(outputs, wl.max_tokens, strict=True))
    short = sum(len(o) < n for o, n in zip(outputs, wl.max_tokens, strict=True))
    if short:
        note = f"{note}; {short} requests got fewer tokens than asked".lstrip("; ")
    return Result(label, useful / seconds, seconds, useful, computed, note, os.getloadavg()[0], outputs)


# ---- (a) Baton end to end ------------------------------------------------------------------
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
    return env


def run_baton_e2e(model_dir: Path, wl: Workload, kv_mb: int, logs: Path, setup: Setup | None = None) -> Result:
    setup = setup or Setup()
    metrics_port = _free_port() if setup.watch_device else 0
    say(f"(a) starting executor and scheduler (logs in {logs})")
    with local_stack(model_dir, logs, overrides=stack_env(setup, kv_mb, metrics_port)) as stack:
        with DeviceWatch(metrics_reader(metrics_port) if metrics_port else None) as watch:
            result = asyncio.run(drive_grpc(stack.target, wl, stack.pids | {"client": os.getpid()}))
        result.device_load = watch.summary()
        return result


async def stream_one(stub: GenerationStub, prompt: list[int], max_tokens: int, bar: tqdm | None = None) -> list[int]:
    params = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens: list[int] = []
    async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, params=params)):
        tokens.extend(chunk.token_ids)
    if bar is not None:
        bar.update()
    return tokens


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    return {name: sum(psutil.Process(pid).cpu_times()[:2]) for name, pid in pids.items()}


def cpu_wait_seconds(pid: int) -> float | None:
    """Seconds the process's threads spent runnable but waiting for a core (Linux schedstat).

    Thread CPU time cannot tell an engine step that was preempted by the other processes from
    one that waited on its own GIL; this can: it counts only the time in the run queue.
    """
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None  # not Linux, or no schedstat in this kernel
    return total / 1e9


async def drive_grpc(target: str, wl: Workload, pids: dict[str, int]) -> Result:
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
        with progress(len(wl.prompts), "(a) Baton end to end over gRPC") as bar:
            wait_before = cpu_wait_seconds(pids["executor"])
            cpu_before, started = cpu_seconds(pids), time.perf_counter()
            jobs = (stream_one(stub, p, n, bar) for p, n in zip(wl.prompts, wl.max_tokens, strict=True))
            outputs = list(await asyncio.gather(*jobs))
            seconds, cpu_after = time.perf_counter() - started, cpu_seconds(pids)
            wait_after = cpu_wait_seconds(pids["executor"])
    used = ", ".join(f"{name} {cpu_after[name] - cpu_before[name]:.1f}" for name in pids)
    note = f"CPU seconds used in the {seconds:.1f} s window ({os.cpu_count()} cores): {used}"
    if wait_before is not None and wait_after is not None:
        note += f"; the executor's threads waited {wait_after - wait_before:.2f} s for a core"
    return finish("(a) Baton end to end (gRPC)", seconds, outputs, wl, sum(map(len, outputs)), note)


# ---- (b) Baton's engine in process ---------------------------------------------------------
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


def run_engine(model_dir: Path, wl: Workload, kv_mb: int, setup: Setup | None = None) -> Result:
    setup = setup or Setup()
    config = ExecutorConfig(
        model=str(model_dir),
        kv_cache_memory_mb=kv_mb,
        max_batch_size=setup.max_batch,
        token_budget=setup.token_budget,
        device=str(setup.torch_device),
        dtype=setup.dtype,
        torch_threads=setup.executor_threads,
    )
    hf_threads = torch.get_num_threads()
    engine = load_engine(config).engine  # sets this process's torch threads as the executor would
    engine_round(engine, [WARM_PROMPT], [WARM_TOKENS], None, setup.max_batch)
    with (
        progress(len(wl.prompts), "(b) Baton engine in process") as bar,
        DeviceWatch(sampler_reader(str(setup.torch_device)) if setup.watch_device else None) as watch,
    ):
        started = time.perf_counter()
        outputs = engine_round(engine, wl.prompts, wl.max_tokens, bar, setup.max_batch)
        seconds = time.perf_counter() - started
    governor = engine.threads
    note = f"torch threads {torch.get_num_threads()}"
    if governor is not None:
        note = f"torch threads {governor.few} for light steps, {governor.many} for heavy ones (the executor default)"
    torch.set_num_threads(hf_threads)  # (c) and (d) get the machine's default, as they would alone
    result = finish("(b) Baton engine in process", seconds, outputs, wl, sum(map(len, outputs)), note)
    result.device_load = watch.summary()
    return result


# ---- (c) and (d): transformers -------------------------------------------------------------
def load_hf(model_dir: Path, setup: Setup) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[setup.dtype])  # sdpa attention
    return model.to(setup.torch_device).eval()


def hf_static_batch(model: Any, prompts: list[list[int]], new: int, pad: int) -> list[list[int]]:
    device = model.device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    # min_new_tokens: EOS cannot end a row early, so every row runs the batch's full length.
    options = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": pad}
    ids, mask = ids.to(device), mask.to(device)
    return model.generate(input_ids=ids, attention_mask=mask, **options)[:, width:].tolist()


def run_hf_static(model_dir: Path, wl: Workload, setup: Setup) -> Result:
    model = load_hf(model_dir, setup)
    pad = int(model.generation_config.pad_token_id)
    hf_static_batch(model, [WARM_PROMPT, WARM_PROMPT[:5]], WARM_TOKENS, pad)
    outputs: list[list[int]] = []
    computed = 0
    with progress(len(wl.prompts), f"(c) HF generate, static batches of {STATIC_BATCH}") as bar:
        started = time.perf_counter()
        for start in range(0, len(wl.prompts), STATIC_BATCH):
            wanted = wl.max_tokens[start : start + STATIC_BATCH]
            rows = hf_static_batch(model, wl.prompts[start : start + STATIC_BATCH], max(wanted), pad)
            outputs += [row[:n] for row, n in zip(rows, wanted, strict=True)]
            computed += len(rows) * max(wanted)
            bar.update(len(rows))
        seconds = time.perf_counter() - started
    note = "each batch runs to its longest output; only each request's own tokens count"
    return finish(f"(c) HF generate, static {STATIC_BATCH}", seconds, outputs, wl, computed, note)


def run_hf_cb(model_dir: Path, wl: Workload, setup: Setup) -> Result:
    label, longest = "(d) HF generate_batch (CB)", max(wl.max_tokens)
    try:
        model = load_hf(model_dir, setup)
        pad = int(model.generation_config.pad_token_id)
        options = {"do_sample": False, "eos_token_id": -1, "pad_token_id": pad}  # eos -1: never stop early
        warm = GenerationConfig(max_new_tokens=WARM_TOKENS, **options)
        model.generate_batch(inputs=[WARM_PROMPT, WARM_PROMPT[:5]], generation_config=warm)
        say(f"(d) HF generate_batch (continuous batching), max_new_tokens={longest} for every request")
        called = time.perf_counter()
        results = model.generate_batch(wl.prompts, GenerationConfig(max_new_tokens=longest, **options))
        call_seconds = time.perf_counter() - called
        got = list(results.values())
        if len(got) != len(wl.prompts) or any(r.error for r in got):
            raise RuntimeError(f"{len(got)} results, errors: {[r.error for r in got if r.error][:3]}")
        # First submit (request creation) to last finish, as in (a)-(c); the call also built its KV cache.
        seconds = max(r.lifespan[1] for r in got) - min(r.created_time for r in got)
        outputs = [r.generated_tokens[:n] for r, n in zip(got, wl.max_tokens, strict=True)]
        computed = sum(len(r.generated_tokens) for r in got)
        note = (
            f"generate_batch takes one max_new_tokens, so every request ran {longest} tokens; only each "
            f"request's own tokens count; whole call incl. setup {call_seconds:.1f} s"
        )
        return finish(label, seconds, outputs, wl, computed, note)
    except Exception as exc:
        say(f"(d) failed: {exc!r}")
        return Result(label, note=f"n/a: {type(exc).__name__}: {exc}")


# ---- report --------------------------------------------------------------------------------
def ratios(results: dict[str, Result]) -> dict[str, float | None]:
    a = results["a"].tok_s if "a" in results else None
    return {f"a/{k}": a / r.tok_s if a and r.tok_s else None for k, r in results.items() if k != "a"}


def same_as_engine(results: dict[str, Result], key: str) -> str:
    ref, got = (results["b"].outputs if "b" in results else None), results[key].outputs
    return "-" if ref is None or got is None else f"{sum(r == g for r, g in zip(ref, got, strict=True))}/{len(ref)}"


def print_report(size: str, results: dict[str, Result], wl: Workload, threads: int) -> None:
    prompt_tokens = sum(map(len, wl.prompts))
    print(f"\n== {size} model: {len(wl.prompts)} requests, {prompt_tokens} prompt tokens, HF threads {threads} ==")
    print(f"{'phase':<30}{'tok/s':>9}{'seconds':>9}{'useful tok':>12}{'computed tok':>14}{'load':>6}  same as (b)")
    for key, res in results.items():
        tok_s = f"{res.tok_s:9.1f}" if res.tok_s else f"{'n/a':>9}"
        cells = f"{tok_s}{res.seconds:9.2f}{res.useful_tokens:12d}{res.computed_tokens:14d}{res.load:6.1f}"
        print(f"{res.label:<30}{cells}  {same_as_engine(results, key)}")
    for name, value in ratios(results).items():
        target = TARGETS.get(name)
        met = "met" if (value or 0) >= (target or 0) else "NOT met"
        verdict = "" if target is None else f"  (target >= {target:g}: {met})"
        print(f"{name} = {'n/a' if value is None else f'{value:.3f}'}{verdict}")
    for key, res in results.items():
        if res.note:
            print(f"note {key}: {res.note}")
        if res.device_load:
            print(f"device load {key}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.device_load.items()))


def run_size(
    size: str,
    wl: Workload,
    workdir: Path,
    phases: list[str],
    setup: Setup,
    on_phase: Callable[[dict[str, Result]], None] = lambda results: None,
) -> dict[str, Result]:
    """Run ``phases`` in order; ``on_phase`` sees the results so far after each one."""
    suffix = "" if setup.dtype == "float32" else f"-{setup.dtype}"
    model_dir, logs = workdir / f"model-{size}{suffix}", workdir / f"logs-{size}{suffix}"
    if not (model_dir / "model.safetensors").exists():
        say(f"generating the {size} model ({setup.dtype}) into {model_dir}")
        make_model(model_dir, size=size, seed=0, dtype=setup.dtype)
    logs.mkdir(exist_ok=True)
    kv_mb = setup.kv_mb or kv_memory_mb(model_dir, wl)
    say(f"== {size}: {model_dir}, {setup}, KV cache {kv_mb} MiB, {len(wl.prompts)} requests ==")
    runners = {
        "a": lambda: run_baton_e2e(model_dir, wl, kv_mb, logs, setup),
        "b": lambda: run_engine(model_dir, wl, kv_mb, setup),
        "c": lambda: run_hf_static(model_dir, wl, setup),
        "d": lambda: run_hf_cb(model_dir, wl, setup),
    }
    results: dict[str, Result] = {}
    for key in phases:
        results[key] = runners[key]()
        gc.collect()
        on_phase(results)
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(SIZES))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="workload seed (the models always use seed 0)")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "baton-bench"))
    parser.add_argument("--json", help="also write the results here as JSON")
    parser.add_argument("--phases", nargs="+", default=list("abcd"), choices=list("abcd"), help="phases to run")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto, for Baton and HF alike (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model and KV dtype")
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH, help="running requests at most (Baton)")
    parser.add_argument("--token-budget", type=int, default=512, help="tokens per engine step (Baton)")
    parser.add_argument("--kv-cache-mb", type=int, default=0, help="Baton's KV cache (default: fits the workload)")
    parser.add_argument("--stream-interval", type=int, default=1, help="(a): tokens per stream write (default 1)")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch threads of (c) and (d) (0: default)")
    parser.add_argument(
        "--executor-threads", type=int, default=0, help="Baton torch threads, (a) and (b); 0: the executor default"
    )
    return parser.parse_args(argv)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM takes the same cleanup path as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    transformers.utils.logging.disable_progress_bar()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    wl = make_workload(args.num_requests, args.seed)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    threads = torch.get_num_threads()
    setup = Setup(
        args.device,
        args.dtype,
        args.max_batch,
        args.token_budget,
        args.kv_cache_mb,
        args.executor_threads,
        args.stream_interval,
    )
    report: dict[str, Any] = {"requests": len(wl.prompts), "seed": args.seed, "wanted_tokens": sum(wl.max_tokens)}
    report |= {"torch": torch.__version__, "transformers": transformers.__version__, "torch_threads": threads}
    report |= {"cpus": os.cpu_count(), "setup": asdict(setup), "sizes": {}}
    if setup.torch_device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(setup.torch_device)
    try:
        for size in args.sizes:

            def record(results: dict[str, Result], size: str = size) -> None:
                # Written after every phase, so a run cut short still leaves what it measured.
                rows = {k: {f: v for f, v in asdict(r).items() if f != "outputs"} for k, r in results.items()}
                report["sizes"][size] = {"results": rows, "ratios": ratios(results)}
                if args.json:
                    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")

            print_report(size, run_size(size, wl, workdir, args.phases, setup, record), wl, threads)
    except KeyboardInterrupt:
        say("interrupted; services stopped")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one engine step's CPU time goes: plan handling, KV bookkeeping, batch metadata, attention,
lm_head, the rest of the forward pass, sampling, detokenisation.

Runs bench/throughput.py's phase (b) workload in process and sums ``time.thread_time()`` around
each stage (wrappers installed on the classes, and on the model and attention function once
loaded). Thread CPU time, not wall time: other work on a shared machine disturbs it far less.
Needs the model directory bench/throughput.py made (``--workdir``), or makes it.

    .venv/bin/python bench/engine_profile.py --size tiny --num-requests 64
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from throughput_engine import engine_round
from throughput_setup import WARM_PROMPT, WARM_TOKENS, Workload, kv_memory_mb, make_workload
from transformers import AttentionInterface

from baton.make_model import SIZES, make_model
from common.config import ExecutorConfig
from executor_service import detokenizer, engine, fast_llama, model_runner, paged_attention, sampling, step_scheduler
from executor_service.model_loader import load_engine

spent: collections.Counter[str] = collections.Counter()


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.thread_time() - started

    return wrapper


def instrument_classes() -> None:
    engine.Engine.step = timed("step", engine.Engine.step)  # type: ignore[method-assign]
    engine.Engine.apply = timed("apply", engine.Engine.apply)  # type: ignore[method-assign]
    engine.Engine._postprocess = timed("postprocess", engine.Engine._postprocess)  # type: ignore[method-assign]
    step_scheduler.StepScheduler.schedule = timed("schedule", step_scheduler.StepScheduler.schedule)  # type: ignore[method-assign]
    model_runner.ModelRunner.run = timed("run", model_runner.ModelRunner.run)  # type: ignore[method-assign]
    sampling.Sampler.sample = timed("sample", sampling.Sampler.sample)  # type: ignore[method-assign]
    detok = detokenizer.IncrementalDetokenizer
    detok.push = timed("detok", detok.push)  # type: ignore[method-assign]


def breakdown(total: float) -> dict[str, float]:
    s = spent
    return {
        "plan handling (Engine.apply)": s["apply"],
        "KV bookkeeping + step scheduling": s["schedule"],
        "batch metadata (ModelRunner.run outside the model)": s["run"] - s["forward"],
        "model forward: attention": s["attention"],
        "model forward: lm_head": s["lm_head"],
        "model forward: rest (linear layers, norms, RoPE)": s["forward"] - s["attention"] - s["lm_head"],
        "sampling": s["sample"],
        "detokenisation": s["detok"],
        "postprocessing besides detokenisation": s["postprocess"] - s["detok"],
        "rest of Engine.step": s["step"] - s["schedule"] - s["run"] - s["sample"] - s["postprocess"],
        "outside the engine (benchmark loop)": total - s["step"] - s["apply"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--num-requests", type=int, default=64, help="the first N of the 64-request workload")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--workdir", default="/tmp/baton-bench")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)

    full = make_workload(64, 0)
    wl = Workload(full.prompts[: args.num_requests], full.max_tokens[: args.num_requests])
    model_dir = Path(args.workdir) / f"model-{args.size}"
    if not (model_dir / "model.safetensors").exists():
        make_model(model_dir, size=args.size, seed=0)
    instrument_classes()
    kv_mb = kv_memory_mb(model_dir, wl)
    config = ExecutorConfig(model=str(model_dir), dtype=args.dtype, kv_cache_memory_mb=kv_mb, max_batch_size=64)
    eng = load_engine(config).engine
    torch.set_num_threads(args.threads)
    model = eng.runner.model
    model.forward = timed("forward", model.forward)  # type: ignore[method-assign]
    if eng.runner.fast_forward is not None:  # the lean Llama forward: time it and its attention calls
        eng.runner.fast_forward = timed("forward", eng.runner.fast_forward)  # type: ignore[assignment]
        fast_llama.paged_attention = timed("attention", fast_llama.paged_attention)
    head = model.get_output_embeddings()
    head.forward = timed("lm_head", head.forward)  # type: ignore[method-assign]
    AttentionInterface.register(paged_attention.ATTENTION_NAME, timed("attention", paged_attention.paged_attention))
    engine_round(eng, [WARM_PROMPT], [WARM_TOKENS], None)
    spent.clear()
    started = time.thread_time()
    outputs = engine_round(eng, wl.prompts, wl.max_tokens, None)
    total = time.thread_time() - started
    rows = breakdown(total)
    tokens = sum(map(len, outputs))
    if args.json:
        summary = {"size": args.size, "dtype": args.dtype, "tokens": tokens, "steps": eng.iteration, "cpu_s": total}
        print(json.dumps({**summary, "rows": rows}))
        return 0
    print(f"{args.size} {args.dtype}: {len(wl.prompts)} requests, {tokens} output tokens, {total:.2f} s thread CPU")
    for name, seconds in rows.items():
        print(f"  {name:<52}{seconds:8.3f} s {100 * seconds / total:6.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())

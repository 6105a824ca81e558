"""The engine's host time per decode step: everything a step spends outside the device's work.

Loads the executor's engine in process (no scheduler, Redis or gRPC), fills it with N requests
that only decode (short prompts, long outputs, EOS ignored), and times each decode step in parts:

- forward: the decode step's device part (``ModelRunner._forward_decodes``: the gathers from the
  decode rows, layers, attention, logits; a graph replay where CUDA graphs are on);
- sample: ``Sampler.sample`` or ``sample_greedy`` (device work on a GPU; on the CPU the host computes it);
- inputs: the rest of ``ModelRunner.run`` (the decode rows' upload);
- engine: the rest of ``Engine.step`` but postprocessing (planning, bookkeeping, the step's report);
- post: ``Engine._postprocess`` (detokenising, stop checks; per request by nature).

host = inputs + engine + post: the per-step cost a GPU would wait on while the host works. On
CUDA the forward and sample timers synchronise, so device time stays in their columns. Printed per
running count, with its growth per request, so a fixed cost and a per-request cost read apart::

    python -m bench.engine_profile --running 64 256 --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from baton.make_model import SIZES, make_model
from common.config import ExecutorConfig
from common.sampling_params import SamplingParams
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, PlanUpdate
from executor_service.model_loader import load_engine


@dataclass(frozen=True)
class StepProfile:
    """Median milliseconds of one decode step at ``running`` requests, by part."""

    running: int
    step_ms: float
    forward_ms: float
    sample_ms: float
    inputs_ms: float
    engine_ms: float  # planning, bookkeeping and the report: the rest of the step but postprocessing
    post_ms: float

    @property
    def host_ms(self) -> float:
        return self.inputs_ms + self.engine_ms + self.post_ms

    @property
    def after_ms(self) -> float:
        """Everything in ``Engine.step`` after ``ModelRunner.run``."""
        return self.sample_ms + self.engine_ms + self.post_ms


class _Timer:
    """Wraps a callable and records the seconds each call took; ``device`` CUDA: waits for its work first."""

    def __init__(
        self, inner: Callable[..., Any], device: torch.device | None = None, seconds: list[float] | None = None
    ) -> None:
        self.inner = inner
        self.seconds: list[float] = [] if seconds is None else seconds  # shared: timers of one part
        self.sync = device is not None and device.type == "cuda"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - started)


def profile_decode(engine: Engine, running: int, steps: int, prompt_len: int = 16) -> StepProfile:
    """Admit ``running`` requests, step until all decode, then time ``steps`` decode steps."""
    runner = engine.runner
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    prompts = [tuple((7 * i + j) % 97 + 3 for j in range(prompt_len)) for i in range(running)]
    specs = tuple(AdmitSpec(f"p{engine.plan_seq}-{i}", p, (), params, float(i)) for i, p in enumerate(prompts))
    engine.apply(PlanUpdate(seq=engine.plan_seq + 1, admit=specs))
    while any(not seq.is_decoding for seq in engine.running.values()):
        engine.step()
    device = runner.device
    run, forward = _Timer(runner.run), _Timer(runner._forward_decodes, device)
    sampler = engine.sampler
    sample, post = _Timer(sampler.sample, device), _Timer(engine._postprocess)
    sample_greedy = _Timer(sampler.sample_greedy, device, sample.seconds)  # one or the other, each step
    runner.run, runner._forward_decodes = run, forward  # type: ignore[method-assign]
    sampler.sample, sampler.sample_greedy, engine._postprocess = sample, sample_greedy, post  # type: ignore[method-assign]
    totals: list[float] = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            out = engine.step()
            totals.append(time.perf_counter() - started)
            if len(out.tokens) != running:
                raise RuntimeError(f"expected {running} decodes a step, got {len(out.tokens)}")
    finally:
        del (
            runner.run,
            runner._forward_decodes,
            sampler.sample,
            sampler.sample_greedy,
            engine._postprocess,
        )  # the classes' own
        engine.apply(PlanUpdate(seq=engine.plan_seq + 1, abort=tuple(s.request_id for s in specs)))
        engine.drain()
    if len(forward.seconds) != steps:
        raise RuntimeError(f"{steps - len(forward.seconds)} of {steps} steps were not decode-only steps")
    inputs = [r - f for r, f in zip(run.seconds, forward.seconds, strict=True)]
    after = [t - r for t, r in zip(totals, run.seconds, strict=True)]
    rest = [a - s - p for a, s, p in zip(after, sample.seconds, post.seconds, strict=True)]
    return StepProfile(
        running=running,
        step_ms=_median_ms(totals),
        forward_ms=_median_ms(forward.seconds),
        sample_ms=_median_ms(sample.seconds),
        inputs_ms=_median_ms(inputs),
        engine_ms=_median_ms(rest),
        post_ms=_median_ms(post.seconds),
    )


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1000.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the generated model of --size)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="generated model size (default tiny)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256], help="running counts (default 64 256)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per count (default 40)")
    parser.add_argument("--kv-cache-mb", type=int, default=1024, help="KV cache size (default 1024)")
    parser.add_argument(
        "--cuda-graphs", choices=("on", "off"), default="on", help="executor.cuda_graphs (default on; CUDA only)"
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (default 16; on CUDA 256 reads in place)"
    )
    parser.add_argument(
        "--static",
        action="store_true",
        help="pad decode steps to batch buckets as on CUDA, run eagerly (the CPU backends run them unpadded)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(args.model) if args.model else Path(scratch) / args.size
        if not args.model:
            make_model(model_dir, size=args.size, seed=0, dtype=args.dtype)
        config = ExecutorConfig(
            model=str(model_dir),
            dtype=args.dtype,
            device=args.device,
            kv_cache_memory_mb=args.kv_cache_mb,
            max_batch_size=max(args.running),
            token_budget=max(2048, max(args.running)),
            cuda_graphs=args.cuda_graphs == "on",
            block_size=args.block_size,
        )
        engine = load_engine(config).engine
        if args.static:
            engine.runner.backend.static_shapes = True
        print(engine.runner.describe())
        profile_decode(engine, min(args.running), 5)  # warm-up: first calls build kernels and caches
        rows = [profile_decode(engine, n, args.steps) for n in args.running]
    print_rows(rows)
    return 0


def print_rows(rows: list[StepProfile]) -> None:
    columns = ("running", "step ms", "forward", "sample", "inputs", "engine", "post", "host ms", "host/req us")
    print(" ".join(f"{c:>{max(8, len(c))}}" for c in columns))
    for row in rows:
        cells = (row.step_ms, row.forward_ms, row.sample_ms, row.inputs_ms, row.engine_ms, row.post_ms, row.host_ms)
        per_request = row.host_ms * 1000 / row.running
        print(f"{row.running:>8} " + " ".join(f"{v:>8.2f}" for v in cells) + f" {per_request:>11.1f}")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        span = last.running - first.running
        for label, before, after in (
            ("host time", first.host_ms, last.host_ms),
            ("inputs + engine", first.inputs_ms + first.engine_ms, last.inputs_ms + last.engine_ms),
        ):
            slope = (after - before) * 1000 / span
            print(f"{label} grows by {slope:.1f} us per running request ({first.running} -> {last.running})")


if __name__ == "__main__":
    raise SystemExit(main())

"""The engine's host time per decode step: everything a step spends outside the model forward.

Loads the executor's engine in process (no scheduler, Redis or gRPC), fills it with N requests
that only decode (short prompts, long outputs, EOS ignored), and times each decode step in
three parts:

- inputs: ``ModelRunner.run`` before the forward (ids, positions, slots, block tables);
- forward: the model's forward pass itself (``ModelRunner._forward``: layers, attention, logits);
- after: the rest of ``Engine.step`` (planning, sampling, detokenising, the step's report).

host = inputs + after: the per-step cost a GPU would wait on while the host works. Printed per
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
    inputs_ms: float
    forward_ms: float
    after_ms: float

    @property
    def host_ms(self) -> float:
        return self.inputs_ms + self.after_ms


class _Timer:
    """Wraps a callable and records the seconds each call took."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.seconds: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
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
    run, forward = _Timer(runner.run), _Timer(runner._forward)
    runner.run, runner._forward = run, forward  # type: ignore[method-assign]
    totals: list[float] = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            out = engine.step()
            totals.append(time.perf_counter() - started)
            if len(out.tokens) != running:
                raise RuntimeError(f"expected {running} decodes a step, got {len(out.tokens)}")
    finally:
        del runner.run, runner._forward  # back to the class's methods
        engine.apply(PlanUpdate(seq=engine.plan_seq + 1, abort=tuple(s.request_id for s in specs)))
        engine.drain()
    ms = 1000.0
    inputs = [r - f for r, f in zip(run.seconds, forward.seconds, strict=True)]
    after = [t - r for t, r in zip(totals, run.seconds, strict=True)]
    return StepProfile(
        running=running,
        step_ms=statistics.median(totals) * ms,
        inputs_ms=statistics.median(inputs) * ms,
        forward_ms=statistics.median(forward.seconds) * ms,
        after_ms=statistics.median(after) * ms,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the generated model of --size)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="generated model size (default tiny)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256], help="running counts (default 64 256)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per count (default 40)")
    parser.add_argument("--kv-cache-mb", type=int, default=1024, help="KV cache size (default 1024)")
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
        )
        engine = load_engine(config).engine
        profile_decode(engine, min(args.running), 5)  # warm-up: first calls build kernels and caches
        rows = [profile_decode(engine, n, args.steps) for n in args.running]
    print(f"{'running':>8} {'step ms':>9} {'forward':>9} {'inputs':>8} {'after':>8} {'host ms':>8} {'host/req us':>12}")
    for row in rows:
        per_request = row.host_ms * 1000 / row.running
        print(
            f"{row.running:>8} {row.step_ms:>9.2f} {row.forward_ms:>9.2f} {row.inputs_ms:>8.2f} "
            f"{row.after_ms:>8.2f} {row.host_ms:>8.2f} {per_request:>12.1f}"
        )
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        slope = (last.host_ms - first.host_ms) * 1000 / (last.running - first.running)
        print(f"host time grows by {slope:.1f} us per running request ({first.running} -> {last.running})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

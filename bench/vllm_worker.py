"""vLLM's side of ``bench/vllm_compare.py``; runs inside the separate vLLM venv, never in Baton's.

Loads ``vllm.LLM`` once, runs a warm-up, prints ``READY <settings json>``; then, for every ``run``
line on stdin (``run PATH``: the workload in that file instead of ``--workload``'s), empties the
prefix cache and generates the whole workload with one offline ``LLM.generate`` call and prints
``RESULT <json>`` (seconds, tokens, outputs). ``quit`` or end of input exits. Logs go to stderr.

The prefix cache is on, as vLLM ships it. The comparison sends fresh prompts every timed run, and
the reset also empties the cache before each run, so only the prefixes a run's own workload shares
are reused. Batch limits are vLLM's own unless given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _engine_limits(llm: object) -> dict[str, object]:
    """The batch limits and prefix caching the engine settled on (its defaults included), where readable."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    scheduler, cache = getattr(config, "scheduler_config", None), getattr(config, "cache_config", None)
    found = {
        "effective_max_num_seqs": getattr(scheduler, "max_num_seqs", None),
        "effective_max_num_batched_tokens": getattr(scheduler, "max_num_batched_tokens", None),
        "effective_prefix_caching": getattr(cache, "enable_prefix_caching", None),
    }
    return {k: v for k, v in found.items() if v is not None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--workload", required=True, help='JSON {"prompts": [[ids]], "max_tokens": [n]}')
    parser.add_argument("--max-num-seqs", type=int, default=0, help="0: vLLM's default")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's prefix cache (default on, as vLLM ships it; emptied before every run)",
    )
    args = parser.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    def load(path: str) -> tuple[list[dict[str, list[int]]], list[SamplingParams]]:
        with open(path) as f:
            workload = json.load(f)
        prompts = [{"prompt_token_ids": ids} for ids in workload["prompts"]]
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=True)
            for n in workload["max_tokens"]
        ]
        return prompts, params

    prompts, params = load(args.workload)
    options: dict[str, object] = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "seed": 0,
        "enforce_eager": args.enforce_eager,
        "enable_prefix_caching": args.prefix_caching,
    }
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name):
            options[name] = getattr(args, name)
    llm = LLM(**options)  # type: ignore[arg-type]
    warm = [{"prompt_token_ids": [1, 5, 6, 7, 8, 9, 10, 11]}] * 2
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    shown = ("VLLM_CPU", "VLLM_ENABLE", "OMP_", "MALLOC_", "LD_PRELOAD")
    env = {k: v for k, v in os.environ.items() if k.startswith(shown)}
    settings = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "env": env,
        **options,
        **_engine_limits(llm),
    }
    print("READY " + json.dumps(settings), flush=True)
    for line in sys.stdin:
        command, _, path = line.strip().partition(" ")
        if command == "quit":
            break
        if command != "run":
            continue
        run_prompts, run_params = load(path) if path else (prompts, params)
        # reset_prefix_cache is not in every vLLM release; False when blocks are still in use.
        reset = bool(llm.reset_prefix_cache()) if hasattr(llm, "reset_prefix_cache") else None
        started = time.perf_counter()
        outputs = llm.generate(run_prompts, run_params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        result = {"seconds": seconds, "tokens": sum(map(len, tokens)), "outputs": tokens, "cache_reset": reset}
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""vLLM's side of ``bench/vllm_compare.py``; runs inside the separate vLLM venv, never in Baton's.

Loads ``vllm.LLM`` once, runs a warm-up, prints ``READY <settings json>``; then, for every ``run`` line
on stdin, generates the whole workload with one offline ``LLM.generate`` call and prints
``RESULT <json>`` (seconds, tokens, outputs). ``quit`` or end of input exits. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--workload", required=True, help='JSON {"prompts": [[ids]], "max_tokens": [n]}')
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="vLLM's prefix cache (off by default: the workload repeats run after run, so it would reuse "
        "the previous run's prompts, which a workload without shared prefixes never offers)",
    )
    args = parser.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    with open(args.workload) as f:
        workload = json.load(f)
    prompts = [{"prompt_token_ids": ids} for ids in workload["prompts"]]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=True) for n in workload["max_tokens"]
    ]
    options: dict[str, object] = {
        "model": args.model,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "seed": 0,
        "enforce_eager": args.enforce_eager,
        "enable_prefix_caching": args.prefix_caching,
    }
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
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
    }
    print("READY " + json.dumps(settings), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "run":
            continue
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        result = {"seconds": seconds, "tokens": sum(map(len, tokens)), "outputs": tokens}
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

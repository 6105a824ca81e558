"""What bench/throughput.py's phases share: the workload, the settings, the result record, sizing and output."""

from __future__ import annotations

import json
import math
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

BOS, MAX_BATCH, STATIC_BATCH, BLOCK = 1, 64, 16, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARM_PROMPT, WARM_TOKENS = [BOS, 5, 6, 7, 8, 9, 10, 11], 4


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
    executors: int = 1  # (a): executor processes, each with the whole model
    rpc: str = "generate"  # (a): a Generate stream per request, or "batch": one GenerateBatch stream
    engine_processes: int = 1  # (b): engine processes, the workload dealt round-robin between them
    request_chunk: int = 0  # (a): each request's own stream_interval_tokens (0: the server's alone)
    report_every_steps: int = 1  # (a): the executors' executor.report_every_steps
    # Every phase runs the whole workload once, untimed, before its timed run (as bench/vllm_compare.py
    # warms both sides): what is timed is a warm server, not its first minute. False: one short
    # request only.
    warm_workload: bool = True
    cuda_graphs: bool = True  # (a) and (b): executor.cuda_graphs (decode steps replayed as CUDA graphs; CUDA only)
    async_scheduling: str = "auto"  # (a) and (b): executor.async_scheduling (overlapped steps; auto: CUDA)
    block_size: int = 16  # (a) and (b): executor.block_size (256 lets CUDA decodes read the KV cache in place)

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


def kv_memory_mb(model_dir: Path, wl: Workload, block: int = BLOCK) -> int:
    """Enough KV cache (in the model's dtype) for every request at full length at once in blocks of
    ``block`` tokens, plus a quarter."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    element = DTYPES[cfg.get("dtype") or cfg.get("torch_dtype") or "float32"].itemsize
    per_token = 2 * cfg["num_hidden_layers"] * (cfg.get("num_key_value_heads") or heads) * head_dim * element
    tokens = sum(-(-(len(p) + n + 1) // block) * block for p, n in zip(wl.prompts, wl.max_tokens, strict=True))
    return max(256, 256 * math.ceil(tokens * per_token * 1.25 / 2**20 / 256))


def finish(label: str, seconds: float, outputs: list[list[int]], wl: Workload, computed: int, note: str) -> Result:
    useful = sum(min(len(o), n) for o, n in zip(outputs, wl.max_tokens, strict=True))
    short = sum(len(o) < n for o, n in zip(outputs, wl.max_tokens, strict=True))
    if short:
        note = f"{note}; {short} requests got fewer tokens than asked".lstrip("; ")
    return Result(label, useful / seconds, seconds, useful, computed, note, os.getloadavg()[0], outputs)

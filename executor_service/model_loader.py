"""Builds an Engine from a model directory or hub id: model, tokenizer, device, dtype, KV cache."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from common.block_hashing import UNKEYED, BlockNaming
from common.config import ExecutorConfig
from common.sampling_defaults import SamplingDefaults
from executor_service.backends.registry import select_backend
from executor_service.block_allocator import BlockAllocator
from executor_service.cpu_threads import OtherLoad, ThreadGovernor, usable_cores
from executor_service.engine import Engine, EngineLimits
from executor_service.grammar_cache import GrammarCache
from executor_service.host_allocator import keep_freed_memory
from executor_service.kv_cache import KVGeometry, KVPool
from executor_service.model_runner import ModelRunner
from executor_service.model_support import ModelTraits
from executor_service.paged_attention import register
from executor_service.sliding_window import SlidingWindow

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    engine: Engine
    tokenizer: object
    model_name: str
    device: torch.device
    dtype: str
    vocab_size: int
    backend: str  # the name of the forward-pass backend that runs the model (backends/registry.py)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)  # its generation_config


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name} requested but CUDA is not available")
    return torch.device(name)


def kv_geometry(model: torch.nn.Module, dtype: torch.dtype) -> KVGeometry:
    cfg = cast(PretrainedConfig, model.config)
    heads = cfg.num_attention_heads
    return KVGeometry(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        dtype=dtype,
    )


def eos_ids(model: torch.nn.Module, tokenizer: object) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    token_id = getattr(tokenizer, "eos_token_id", None)
    if isinstance(token_id, int):
        ids.add(token_id)
    return frozenset(ids)


def servable_length(
    model_config: Any, num_blocks: int, block_size: int, window: SlidingWindow | None, token_budget: int
) -> int:
    """The longest prompt plus output served: the model's, within what the KV cache holds (as vLLM
    will not start a model whose length its KV cache cannot hold), so a request that passes the
    scheduler's length check can always run, alone if need be, instead of failing part way. A
    model whose every layer is windowed holds only its window's blocks and one chunk's, at any
    length, where the cache holds that many."""
    model_len = int(getattr(model_config, "max_position_embeddings", 2048))
    kv_tokens = num_blocks * block_size
    if kv_tokens >= model_len:
        return model_len
    if (
        window is not None
        and window.every_layer
        and window.most_blocks_held(model_len, token_budget, block_size) <= num_blocks
    ):
        return model_len
    log.warning(
        "the KV cache holds %d tokens, fewer than the model's %d: requests are limited to %d tokens "
        "(prompt and output; raise executor.kv_cache_memory_mb for more)",
        kv_tokens,
        model_len,
        kv_tokens,
    )
    return kv_tokens


def load_engine(
    config: ExecutorConfig, peers: Callable[[], int] = lambda: 0, naming: BlockNaming = UNKEYED
) -> LoadedModel:
    """``peers``: how many other executors share this host's cores (``host_peers.HostPeers``, which
    the executor service registers; an engine run in process, as the benchmarks do, counts none)."""
    if not config.model:
        raise ValueError("executor.model is not set (a model directory or hub id)")
    device = resolve_device(config.device)
    dtype = DTYPES[config.dtype]
    # Chosen from the config alone: a model no backend computes exactly is refused before its weights load.
    try:
        model_config = AutoConfig.from_pretrained(config.model)
    except OSError as exc:  # no such directory, no config.json, a hub id with no network
        raise ValueError(f"executor.model {config.model!r} cannot be loaded: {exc}") from exc
    traits = ModelTraits.from_config(model_config)
    backend_class = select_backend(traits, device, dtype, config.backend)
    threads = None
    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    elif device.type == "cpu":
        threads = ThreadGovernor(usable_cores(), torch.set_num_threads, OtherLoad(), peers)
        threads.before_step()  # loading and warm-up run with all cores but one, like light steps
    if device.type == "cpu":
        keep_freed_memory()
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    model = AutoModelForCausalLM.from_pretrained(
        config.model, config=model_config, dtype=dtype, attn_implementation=register()
    )
    # transformers wraps .to with functools.wraps; typeshed's _Wrapped has no __get__, so mypy binds no self.
    model.to(device).eval()  # type: ignore[arg-type]
    backend = backend_class(model, device, dtype, private_torch=config.torch_private_ops)
    geometry = kv_geometry(model, dtype)
    num_blocks = geometry.num_blocks_for(config.kv_cache_memory_mb * 1024 * 1024, config.block_size)
    allocator = BlockAllocator(num_blocks, config.block_size, config.prefix_caching)
    pool = KVPool(geometry, num_blocks, config.block_size, device)
    window = SlidingWindow.of(traits)
    backend.bind_kv(pool, window)
    log.info("backend %s: %s", backend.name, backend.describe())
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    limits = EngineLimits(
        max_model_len=servable_length(model.config, num_blocks, config.block_size, window, config.token_budget),
        max_batch_size=config.max_batch_size,
        token_budget=config.token_budget,
        eos_token_ids=eos_ids(model, tokenizer),
        eos_token_id=tokenizer_eos if isinstance(tokenizer_eos, int) else None,
    )
    log.info(
        "loaded %s on %s (%s): %d KV blocks of %d tokens, max_model_len %d",
        config.model,
        device,
        config.dtype,
        num_blocks,
        config.block_size,
        limits.max_model_len,
    )
    runner = ModelRunner(
        backend,
        pool,
        allocator,
        device,
        max_seqs=config.max_batch_size,
        max_model_len=limits.max_model_len,
        cuda_graphs=config.cuda_graphs,
        window=window,
    )
    log.info("%s", runner.describe())
    if runner.window is not None:
        layers = "every layer: blocks it has passed are released" if runner.window.every_layer else "some layers"
        log.info("sliding window of %d tokens on %s", runner.window.size, layers)
    if runner.graphs is not None:
        started = time.perf_counter()
        count = runner.capture_decode_graphs()
        log.info("captured %d decode graphs in %.1f s", count, time.perf_counter() - started)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    grammars = GrammarCache(tokenizer, vocab, limits.eos_token_ids)  # compiles nothing until asked
    overlap = config.async_scheduling == "on" or (config.async_scheduling == "auto" and device.type == "cuda")
    engine = Engine(runner, allocator, tokenizer, limits, threads, grammars, overlap=overlap, naming=naming)
    if engine.overlap:
        log.info("overlapped steps: each decode step launches before the last one's tokens are read")
    defaults = SamplingDefaults.of_generation_config(getattr(model, "generation_config", None))
    return LoadedModel(engine, tokenizer, config.model, device, config.dtype, vocab, backend.name, defaults)

"""Sliding-window models served exactly beyond their window, on every backend that declares windows,
and the KV blocks a window has passed released where every layer is windowed: a long generation
holds a bounded number of blocks, and every reference comes back after finish, cancel and preemption."""

from __future__ import annotations

import json
import random
import shutil
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest

from baton.make_model import make_model
from common.sampling_params import SamplingParams
from executor_service.backends.base import DecodeRead
from executor_service.backends.cuda import CudaBackend
from executor_service.batch_admission import Admission, judge_admission
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, PlanUpdate
from executor_service.model_loader import servable_length
from executor_service.model_support import ModelTraits
from executor_service.sliding_window import SlidingWindow
from tests.executor_service.reference import (
    Reference,
    assert_matches_reference,
    load_reference_model,
    reference_greedy,
)
from tests.executor_service.test_engine import admit, make_engine, run_to_end

WINDOW = 16
NEW_TOKENS = 60


def windowed_model(out: Path, arch: str, full_layers: int = 0) -> Path:
    """``baton make-model --arch`` with its config's window set to WINDOW; Qwen2's first ``full_layers``
    layers keep full attention (its ``max_window_layers``), as transformers' Qwen2Config lays them out."""
    if not (out / "config.json").exists():
        make_model(out, arch=arch)
    config = json.loads((out / "config.json").read_text())
    config["sliding_window"] = WINDOW
    if arch == "qwen2":
        config.update(use_sliding_window=True, max_window_layers=full_layers)
        layers = range(config["num_hidden_layers"])
        config["layer_types"] = ["full_attention" if i < full_layers else "sliding_attention" for i in layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    made = {arch: windowed_model(root / arch, arch) for arch in ("mistral", "qwen2", "gemma2")}
    # The same Qwen2 weights with two full-attention layers under two windowed ones.
    made["qwen2-mixed"] = windowed_model(shutil.copytree(made["qwen2"], root / "qwen2-mixed"), "qwen2", full_layers=2)
    return made


@cache
def _reference(model_dir: Path, prompt: tuple[int, ...], max_tokens: int) -> Reference:
    return reference_greedy(_reference_model(model_dir), list(prompt), max_tokens)


@cache
def _reference_model(model_dir: Path):  # type: ignore[no-untyped-def]
    return load_reference_model(model_dir)


def _prompts(seed: int, count: int = 4) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"w{i}": [1] + [rng.randrange(5, 8000) for _ in range(rng.randrange(30, 60))] for i in range(count)}


def _real_blocks(engine: Engine, table: list[int]) -> int:
    return sum(block != engine.allocator.placeholder for block in table)


# (model, backend, read): every backend that declares windows, each way its decodes read the cache.
CASES = [
    ("mistral", "cpu_native", "native"),  # the lean Llama forward passes Mistral's window
    ("mistral", "cpu_transformers", "native"),
    ("mistral", "cpu_transformers", "overlap"),  # native decodes launched before the last step's tokens are read
    ("mistral", "torch", "in_place"),
    ("mistral", "cuda", "gathered"),  # the CUDA backend's code on the CPU: static-shape gathered decodes
    ("mistral", "cpu_transformers", "scattered"),  # gathered decodes and prefill contexts over scattered blocks
    ("qwen2", "cpu_transformers", "native"),  # max_window_layers 0: every layer windowed
    ("qwen2-mixed", "cpu_transformers", "native"),  # full and windowed layers in one model
    ("qwen2-mixed", "torch", "in_place"),
    ("qwen2-mixed", "torch", "scattered"),
    ("gemma2", "torch", "in_place"),  # alternating windowed and global layers, soft-capped
]


@pytest.mark.parametrize(("model", "backend", "read"), CASES)
def test_greedy_beyond_the_window_matches_generate(
    models: dict[str, Path], model: str, backend: str, read: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of 30-60 tokens and 60 new ones, a window of 16, staggered joins, chunked prefill
    (a budget of 24 tokens): token for token what ``model.generate`` gives each prompt alone."""
    model_dir = models[model]
    overlap = "on" if read == "overlap" else "off"
    engine = make_engine(
        model_dir,
        backend="torch" if backend == "cuda" else backend,
        token_budget=24,
        block_size=8,
        async_scheduling=overlap,
    )
    assert engine.overlap == (read == "overlap")
    runner = engine.runner
    window = runner.window
    assert window is not None and window.size == WINDOW
    assert window.every_layer == (model in ("mistral", "qwen2"))
    assert engine.limits.max_model_len == 4096, "the window does not cap the context"
    if backend == "cuda":
        cuda = CudaBackend(runner.model, runner.device, runner.pool.keys.dtype)
        cuda.lean.native_layer_ops = False  # on CUDA the layer ops are never native
        runner.backend, runner.decode_read = cuda, cuda.decode_read
    elif read == "scattered":
        runner.decode_read = DecodeRead.GATHERED
        monkeypatch.setattr(engine.allocator, "contiguous_start", lambda table: None)
    assert runner.backend.name == backend
    native, in_place = ("native", "overlap"), ("in_place",)
    assert runner.decode_read is (
        DecodeRead.NATIVE if read in native else DecodeRead.IN_PLACE if read in in_place else DecodeRead.GATHERED
    )
    prompts = _prompts(seed=11)
    arrivals: dict[int, list[AdmitSpec]] = {}
    for step, rid in zip([0, 0, 3, 8], prompts, strict=True):
        arrivals.setdefault(step, []).append(admit(rid, prompts[rid], NEW_TOKENS))
    held = _held_blocks_per_step(engine)
    got = run_to_end(engine, arrivals)
    for rid, prompt in prompts.items():
        assert_matches_reference(got[rid], _reference(model_dir, tuple(prompt), NEW_TOKENS), rid)
    assert engine.allocator.num_used == 0
    if window.every_layer:  # each decoding sequence held its window's blocks and the next token's
        assert max(held) <= window.span_blocks(8) + 1, held


def _held_blocks_per_step(engine: Engine) -> list[int]:
    """Record, after every step, the most real blocks any decoding sequence holds."""
    held: list[int] = []
    step = engine.step

    def recording():  # type: ignore[no-untyped-def]
        out = step()
        decoding = [s for s in engine.running.values() if s.is_decoding]
        held.append(max((_real_blocks(engine, s.block_table) for s in decoding), default=0))
        return out

    engine.step = recording  # type: ignore[method-assign]
    return held


def test_a_long_generation_fits_a_pool_smaller_than_it(models: dict[str, Path]) -> None:
    """340 tokens through a pool of 256 (16 blocks of 16): the sequence holds its window's blocks
    and the next token's at any time, however long it runs, and the output is exact."""
    model_dir = models["mistral"]
    engine = make_engine(model_dir, kv_cache_memory_mb=1, block_size=16)
    allocator, window = engine.allocator, engine.runner.window
    assert window is not None and allocator.num_blocks == 16
    prompt, new = _prompts(seed=4, count=1)["w0"][:40], 300
    for verdict, given in ((Admission.TOO_LONG, None), (Admission.ADMIT, window)):  # all of it would not fit
        assert verdict is judge_admission(
            len(prompt) + new, 0, max_model_len=4096, max_batch_size=8, token_budget=96, kv=allocator, window=given
        )
    used: list[int] = []
    step = engine.step

    def recording():  # type: ignore[no-untyped-def]
        out = step()
        used.append(allocator.num_used)
        return out

    engine.step = recording  # type: ignore[method-assign]
    got = run_to_end(engine, {0: [admit("long", prompt, new)]})["long"]
    assert_matches_reference(got, _reference(model_dir, tuple(prompt), new), "long")
    assert max(used) <= window.span_blocks(16) + 1, max(used)
    assert allocator.num_used == 0


def test_a_plan_s_budget_is_held_to_what_the_pool_holds_beside_a_window(models: dict[str, Path]) -> None:
    """The scheduler's budget may outgrow the executor's: a chunk that large beside a whole window
    would not fit 16 blocks, and a request the executor serves would be refused as too long once
    it had grown. The budget is held to the pool's room, set before the plan's admits are judged."""
    model_dir = models["mistral"]
    engine = make_engine(model_dir, kv_cache_memory_mb=1, block_size=16)
    assert engine.limits.max_model_len == 4096  # a window and a chunk of 96 fit the pool
    prompt, new = _prompts(seed=4, count=1)["w0"][:40], 300
    engine.apply(PlanUpdate(seq=1, token_budget=2048, admit=(admit("long", prompt, new),)))
    assert engine.token_budget == 15 * 16 - WINDOW + 1  # a window and a chunk in 16 blocks
    got: list[int] = []
    while engine.has_work:
        got += [t for delta in engine.step().tokens for t in delta.token_ids]
    assert_matches_reference(got, _reference(model_dir, tuple(prompt), new), "long")


def test_servable_length_of_a_windowed_model_counts_its_window_and_a_chunk() -> None:
    config = SimpleNamespace(max_position_embeddings=4096)
    window = SlidingWindow(size=40, every_layer=True)
    # 16 blocks of 16 hold a window of 40 and a chunk of 96 (8 blocks), not a chunk of 2048.
    assert servable_length(config, 16, 16, window, token_budget=96) == 4096
    assert servable_length(config, 16, 16, window, token_budget=2048) == 256
    assert servable_length(config, 16, 16, SlidingWindow(size=40, every_layer=False), token_budget=96) == 256
    assert servable_length(config, 256, 16, None, token_budget=2048) == 4096


def _assert_every_block_back(engine: Engine) -> None:
    """No reference left and none dropped twice: the whole pool is free, and can be taken in one table."""
    allocator = engine.allocator
    assert allocator.num_used == 0 and allocator.num_free == allocator.num_blocks
    assert not any(allocator._refs)
    table: list[int] = []
    allocator.grow(table, allocator.num_blocks * allocator.block_size)
    assert sorted(table) == list(range(allocator.num_blocks))
    allocator.release(table)


def test_cancel_and_preemption_return_every_block_and_a_resumed_request_stays_exact(
    models: dict[str, Path],
) -> None:
    """Three requests run well past the window (blocks released, the named ones cached); one is
    cancelled, one preempted and later resumed with its output so far (its prefill matches the blocks
    it left cached), one finishes. The resumed request's output is exact, and every block comes back."""
    model_dir = models["mistral"]
    engine = make_engine(model_dir, token_budget=24, block_size=8)
    prompts = _prompts(seed=23, count=3)
    engine.apply(PlanUpdate(seq=1, admit=tuple(admit(rid, prompt, NEW_TOKENS) for rid, prompt in prompts.items())))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(30):
        for delta in engine.step().tokens:
            tokens[delta.request_id] += delta.token_ids
    assert all(_real_blocks(engine, s.block_table) < len(s.block_table) for s in engine.running.values())
    engine.apply(PlanUpdate(seq=2, abort=("w0",), preempt=("w1",)))
    out = engine.drain()
    assert [f.request_id for f in out.finished] == ["w0"] and out.preempted == ("w1",)
    survivor = engine.running["w2"]
    assert engine.allocator.num_used == _real_blocks(engine, survivor.block_table)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    resumed = AdmitSpec("w1", tuple(prompts["w1"]), tuple(tokens["w1"]), params, 0.0)
    cached: list[int] = []  # what its first output says it took from the cache
    step = engine.step

    def recording():  # type: ignore[no-untyped-def]
        out = step()
        cached.extend(d.num_cached for d in out.tokens if d.request_id == "w1" and d.num_cached is not None)
        return out

    engine.step = recording  # type: ignore[method-assign]
    rest = run_to_end(engine, {0: [resumed]})
    engine.step = step  # type: ignore[method-assign]
    assert cached and cached[0] > 0, "the resumed request matched no block it left cached"
    assert_matches_reference(tokens["w1"] + rest["w1"], _reference(model_dir, tuple(prompts["w1"]), NEW_TOKENS), "w1")
    while engine.has_work:
        engine.step()
    _assert_every_block_back(engine)


def test_a_prompt_seen_before_starts_from_the_blocks_its_window_released(models: dict[str, Path]) -> None:
    """The first request's blocks were released as its window passed them; named, they stayed cached,
    so the same prompt later starts from them and gives the same tokens."""
    model_dir = models["qwen2"]
    engine = make_engine(model_dir, block_size=8)
    prompt = _prompts(seed=31, count=1)["w0"]
    first = run_to_end(engine, {0: [admit("a", prompt, 30)]})["a"]
    assert engine.prefix_cache.hits == 0
    again = run_to_end(engine, {0: [admit("b", prompt, 30)]})["b"]
    assert engine.prefix_cache.hits == (len(prompt) - 1) // 8 * 8
    assert first == again
    assert_matches_reference(again, _reference(model_dir, tuple(prompt), 30), "b")
    _assert_every_block_back(engine)


def test_the_window_rules() -> None:
    window = SlidingWindow(size=16, every_layer=True)
    assert [window.first_key(p) for p in (0, 15, 16, 40)] == [0, 0, 1, 25]
    assert window.span_blocks(16) == 2 and window.span_blocks(8) == 3 and SlidingWindow(1, True).span_blocks(8) == 1
    assert [window.passed_blocks(n, 8) for n in (0, 23, 24, 40)] == [0, 1, 1, 3]
    assert window.most_blocks_held(1000, 1, 8) == 3 and window.most_blocks_held(10, 1, 8) == 2
    assert window.most_blocks_held(1000, 24, 8) == 6
    mixed = SlidingWindow(size=16, every_layer=False)
    assert mixed.passed_blocks(400, 8) == 0 and mixed.most_blocks_held(1000, 1, 8) == 125
    # What Info reports: the window blocks are released behind, none where some layer reads them all.
    assert window.releasing_size == 16 and mixed.releasing_size == 0
    # The largest chunk with which 1000 tokens fit 6 blocks of 8 (a window and 25 tokens reach 6).
    assert window.most_chunk(6, 8, 1000) == 25 and window.most_blocks_held(1000, 25, 8) == 6
    assert window.most_blocks_held(1000, 26, 8) == 7 and window.most_chunk(200, 8, 1000) is None
    with pytest.raises(ValueError):
        SlidingWindow(size=0, every_layer=True)
    assert SlidingWindow.of(ModelTraits.from_config(SimpleNamespace(model_type="llama"))) is None

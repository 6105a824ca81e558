"""Decode-only steps from the persistent rows: batch buckets, padding that touches only the scratch
block, and the static (padded) path token for token against ``model.generate``, run eagerly on
the CPU: the path a CUDA graph captures."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from executor_service.backends.base import DecodeRead
from executor_service.decode_step import DecodeShape, batch_buckets, bucket, width_bucket
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec, PlanUpdate
from executor_service.paged_attention import AttentionBatch
from executor_service.sequence import Sequence
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.executor_service.test_engine import admit, make_engine, run_to_end


def test_batch_buckets_are_nano_vllms_up_to_the_first_that_holds_the_batch() -> None:
    assert batch_buckets(256) == (1, 2, 4, 8, *range(16, 257, 16))
    assert batch_buckets(1) == (1,)
    assert batch_buckets(5) == (1, 2, 4, 8)
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 32)
    assert [bucket(n, batch_buckets(64)) for n in (1, 3, 5, 8, 9, 17, 64)] == [1, 4, 8, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        bucket(65, batch_buckets(64))
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_widths_round_up_to_a_power_of_two_within_the_rows() -> None:
    assert [width_bucket(w, 256) for w in (1, 2, 3, 5, 8, 9, 200, 256)] == [1, 2, 4, 8, 8, 16, 256, 256]
    assert width_bucket(100, 96) == 96  # never wider than a row


def _decoding(engine: Engine, count: int, max_tokens: int = 30) -> list[Sequence]:
    """``count`` requests prefilled and decoding, in rank order."""
    specs = tuple(admit(f"d{i}", [1, 5 + i, 6, 7 + i], max_tokens, rank=i) for i in range(count))
    engine.apply(PlanUpdate(seq=engine.plan_seq + 1, admit=specs))
    while any(not s.is_decoding for s in engine.running.values()):
        engine.step()
    return sorted(engine.running.values(), key=lambda s: s.rank)


def test_a_padded_step_feeds_its_padding_through_the_scratch_row(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    runner = engine.runner
    seqs = _decoding(engine, 3)
    decode, pool = runner.decode, runner.pool
    shape = decode.prepare(seqs, static=True)
    assert shape == DecodeShape(count=3, batch=4, width=1)
    state = decode.state
    rows = [s.decode_row for s in seqs]
    assert state.step_rows[:4].tolist() == [*rows, state.scratch_row]
    seen: dict[str, torch.Tensor] = {}

    def forward(ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        reads = batch.full
        assert batch.windowed is None and reads is not None
        assert reads.native_decodes is not None and not reads.prefills and reads.decodes is None
        seen.update(ids=ids, positions=positions, keep=keep, slots=batch.slot_mapping)
        seen["lengths"] = reads.native_decodes.lengths
        return torch.zeros(len(keep), 8)

    assert decode.forward(forward, DecodeRead.NATIVE, shape.batch, shape.width).shape == (4, 8)
    size = pool.block_size
    assert seen["ids"].tolist() == [s.output_ids[-1] for s in seqs] + [0]
    assert seen["positions"].tolist() == [s.num_computed for s in seqs] + [0]
    want_slots = [pool.slots(s.block_table, s.num_computed, s.num_computed + 1)[0] for s in seqs]
    assert seen["slots"].tolist() == [*want_slots, pool.scratch_block * size]
    assert seen["lengths"].tolist() == [s.num_tokens for s in seqs] + [1]
    assert seen["keep"].tolist() == [0, 1, 2, 3]


def test_padding_writes_only_the_scratch_block(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.runner.backend.static_shapes = True
    seqs = _decoding(engine, 5)  # bucket 8: three padded rows
    pool = engine.runner.pool
    before = pool.keys.clone()
    engine.step()
    changed = (pool.keys != before).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
    scratch = range(pool.scratch_block * pool.block_size, (pool.scratch_block + 1) * pool.block_size)
    written = {pool.slots(s.block_table, s.num_computed - 1, s.num_computed)[0] for s in seqs}
    assert set(changed) - set(scratch) == written
    assert set(changed) & set(scratch)  # the padded rows did write, there


@pytest.mark.parametrize("read", ["native", "gathered", "paged"])
def test_static_decode_steps_crossing_buckets_match_generate(tiny_model_dir: Path, read: str) -> None:
    """Requests join and finish so the decode batch crosses bucket bounds both ways (1 -> 33 -> 1),
    every decode step padded; ``native``: the CPU kernel reads the padded rows' tables, ``gathered``:
    the masked gather over a fixed width that the CUDA backend uses, ``paged``: the whole tables and
    lengths that the CUDA backend's in-place kernel reads (here its gathered oracle computes them)."""
    engine = make_engine(tiny_model_dir, token_budget=512)
    runner = engine.runner
    runner.backend.static_shapes = True
    if read != "native":
        runner.decode_read = DecodeRead(read)
    shapes: list[DecodeShape] = []
    real = runner._forward_decodes

    def record(shape: DecodeShape) -> torch.Tensor:
        shapes.append(shape)
        return real(shape)

    runner._forward_decodes = record  # type: ignore[method-assign]
    rng = random.Random(3)
    arrivals: dict[int, list[AdmitSpec]] = {}
    joins = {0: 1, 2: 1, 4: 1, 6: 2, 8: 4, 10: 8, 12: 16}  # running: 1, 2, 3, 5, 9, 17, 33
    specs: list[AdmitSpec] = []
    for step, count in joins.items():
        for _ in range(count):
            prompt = [1] + [rng.randrange(5, 8000) for _ in range(rng.randrange(2, 40))]
            spec = admit(f"r{len(specs)}", prompt, rng.randrange(20, 48))
            specs.append(spec)
            arrivals.setdefault(step, []).append(spec)
    outputs = run_to_end(engine, arrivals)
    reference_model = load_reference_model(tiny_model_dir)
    for spec in specs:
        ref = reference_greedy(reference_model, list(spec.prompt_ids), spec.params.max_tokens)
        assert_matches_reference(outputs[spec.request_id], ref, spec.request_id)
    batches = {s.batch for s in shapes}
    assert {1, 2, 4, 8, 16, 32, 48} <= batches, batches  # 33 running pads to 48
    assert any(s.batch > s.count for s in shapes)
    assert all(s.batch == bucket(s.count, runner.decode.buckets) for s in shapes)
    assert all(s.width & (s.width - 1) == 0 for s in shapes)  # powers of two
    assert runner.decode.state.num_free == runner.decode.state.scratch_row  # every row came back
    assert engine.allocator.num_used == 0

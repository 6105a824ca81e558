"""The persistent decode rows: preallocated once and reused every step, block tables mirrored
entry by entry as they grow, tokens seeded from the host only when not sampled here, one upload a
step, and every row back when its request leaves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_service.decode_state import DecodeState
from executor_service.engine import Engine
from executor_service.engine_io import PlanUpdate
from executor_service.sequence import Sequence
from tests.executor_service.test_engine import admit, make_engine, prompts


def _tensors(state: DecodeState) -> dict[str, torch.Tensor]:
    return {"tokens": state.tokens, "positions": state.positions, "tables": state.tables, "rows": state.step_rows}


def _assert_rows_match(engine: Engine) -> None:
    """Each decoding sequence's row holds its next token, its position and its block table."""
    state = engine.runner.decode.state
    for seq in engine.running.values():
        if not seq.decode_live:
            continue
        row = seq.decode_row
        assert row is not None
        assert int(state.tokens[row]) == seq.token_slice(seq.num_computed, seq.num_computed + 1)[0]
        assert int(state.positions[row]) == seq.num_computed
        assert state.tables[row, : seq.decode_blocks].tolist() == seq.block_table[: seq.decode_blocks]


def test_the_rows_are_allocated_once_and_reused_every_step(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_batch_size=8)
    state = engine.runner.decode.state
    tensors = _tensors(state)
    pointers = {name: t.data_ptr() for name, t in tensors.items()}
    assert state.tables.shape == (9, engine.allocator.blocks_for(engine.limits.max_model_len))  # 8 + scratch
    engine.apply(PlanUpdate(seq=1, admit=tuple(admit(f"a{i}", p, 25) for i, p in enumerate(prompts(3)))))
    for step in range(60):
        if step == 10:
            engine.apply(PlanUpdate(seq=2, admit=tuple(admit(f"b{i}", p, 12) for i, p in enumerate(prompts(4, 2)))))
        if not engine.has_work:
            break
        engine.step()
        _assert_rows_match(engine)
        assert all(_tensors(state)[name] is tensor for name, tensor in tensors.items())  # the same tensors ...
        assert {name: t.data_ptr() for name, t in _tensors(state).items()} == pointers  # ... and storage
    assert not engine.running and state.num_free == 8


def test_a_step_uploads_once_and_only_what_changed(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(tiny_model_dir, block_size=16)
    engine.apply(PlanUpdate(seq=1, admit=tuple(admit(f"u{i}", [1, 5 + i, 6], 40) for i in range(4))))
    engine.step()  # the prompts' prefill; their first tokens land in their rows on the device
    state = engine.runner.decode.state
    uploads: list[list[int]] = []
    real = state._upload

    def upload(values: list[int]) -> torch.Tensor:
        uploads.append(list(values))
        return real(values)

    monkeypatch.setattr(state, "_upload", upload)
    seqs = list(engine.running.values())
    assert all(s.decode_live and s.decode_row is not None for s in seqs)  # sampled here: nothing to seed
    mirrored = 0
    for _ in range(30):
        before = {s.request_id: s.decode_blocks for s in seqs}
        engine.step()
        values = uploads[-1]
        assert values[:4] == [s.decode_row for s in seqs]
        # Beyond the rows: (row, column, block) for each table entry not mirrored yet, and no seed.
        entries = sum(len(s.block_table) - before[s.request_id] for s in seqs)
        assert len(values) == 4 + 3 * entries
        mirrored += entries
    # Positions 3..32: the first block at the first decode, then one more at 16 and at 32.
    assert mirrored == 4 * 3
    assert len(uploads) == 30
    _assert_rows_match(engine)


def test_a_token_not_sampled_here_is_seeded_from_the_host(tiny_model_dir: Path) -> None:
    """A prompt one token past a cached block decodes at once: its token comes from the host."""
    engine = make_engine(tiny_model_dir, block_size=16)
    prompt = [1, *range(100, 115)]  # 16 tokens: one full block, named once computed
    engine.apply(PlanUpdate(seq=1, admit=(admit("first", prompt, 2),)))
    while engine.has_work:
        engine.step()
    engine.apply(PlanUpdate(seq=2, admit=(admit("again", [*prompt, 42], 3),)))
    seq = engine.running["again"]
    assert seq.is_decoding and not seq.decode_live  # the cached block is its whole context but one
    engine.step()
    assert seq.decode_live
    _assert_rows_match(engine)


def test_rows_are_handed_out_and_taken_back(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_batch_size=2)
    state = engine.runner.decode.state
    assert state.num_free == 2
    engine.apply(PlanUpdate(seq=1, admit=(admit("x", [1, 5, 6], 30), admit("y", [1, 7, 8], 30))))
    engine.step()
    rows = {engine.running[r].decode_row for r in ("x", "y")}
    assert rows == {0, 1} and state.num_free == 0
    engine.apply(PlanUpdate(seq=2, abort=("x",)))
    assert state.num_free == 1
    engine.apply(PlanUpdate(seq=3, preempt=("y",)))
    assert state.num_free == 2
    lone = Sequence("z", [1], [], admit("z", [1], 1).params, 0.0, None, None)  # type: ignore[arg-type]
    for _ in range(2):
        state.row_of(lone)
    assert state.num_free == 1  # the same row, asked for twice
    state.release(lone)
    assert state.num_free == 2 and lone.decode_row is None
    with pytest.raises(ValueError):
        DecodeState(max_seqs=4, max_blocks=8, scratch_block=0, step_capacity=2, device=torch.device("cpu"))


def test_an_uncommitted_step_leaves_its_rows_to_be_seeded_again(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logits nobody sampled (a step cut short): the next step takes its rows' tokens from the host."""
    engine = make_engine(tiny_model_dir)
    engine.apply(PlanUpdate(seq=1, admit=(admit("c", [1, 5, 6], 30),)))
    engine.step()
    engine.step()
    runner, seq = engine.runner, engine.running["c"]
    chunks = engine.step_scheduler.schedule([seq], 10, {}).chunks
    state = runner.decode.state
    uploads: list[list[int]] = []
    real = state._upload

    def upload(values: list[int]) -> torch.Tensor:
        uploads.append(list(values))
        return real(values)

    monkeypatch.setattr(state, "_upload", upload)
    runner.run(chunks)  # no commit follows
    runner.run(chunks)
    assert len(uploads[0]) == 1 and len(uploads[1]) == 4  # the row alone, then the row and its seed
    assert uploads[1][1:] == [seq.decode_row, seq.output_ids[-1], seq.num_computed]
    _assert_rows_match(engine)

"""CUDA graphs of the static decode step: ``executor.cuda_graphs``, ignored on the CPU; a capture
that fails leaves the step's eager logits and serving eager. On a GPU: graph replays give the
tokens eager steps give, one graph per shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.config import ExecutorConfig
from common.config_loading import load_config
from executor_service.backends.cuda import CudaBackend
from executor_service.decode_graphs import DecodeGraphs
from executor_service.engine import Engine
from executor_service.engine_io import AdmitSpec
from executor_service.model_runner import ModelRunner
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.executor_service.test_engine import admit, make_engine, prompts, run_to_end

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_graphs_are_on_by_default_and_set_from_config() -> None:
    assert ExecutorConfig().cuda_graphs is True
    assert load_config(None, environ={"BATON_EXECUTOR__CUDA_GRAPHS": "false"}).executor.cuda_graphs is False


def test_the_setting_is_ignored_on_the_cpu_even_for_a_static_backend(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, backend="torch", cuda_graphs=True)
    assert engine.runner.graphs is None
    runner = engine.runner
    backend = CudaBackend(runner.model, runner.device, runner.pool.keys.dtype)  # static shapes, on the CPU
    static = ModelRunner(backend, runner.pool, runner.allocator, runner.device, max_seqs=4, max_model_len=64,
                         cuda_graphs=True)  # fmt: skip
    assert static.graphs is None
    assert static.describe() == "decode steps from persistent rows, padded to batch buckets 1..4, eager"


def test_a_failed_capture_returns_the_eager_logits_and_turns_graphs_off() -> None:
    """No CUDA here, so capturing fails as an op torch cannot capture would."""
    calls: list[tuple[int, int]] = []

    def forward(batch: int, width: int) -> torch.Tensor:
        calls.append((batch, width))
        return torch.full((batch, 3), float(width))

    graphs = DecodeGraphs(forward, max_batch=8)
    assert graphs.run(4, 2).tolist() == [[2.0] * 3] * 4
    assert graphs.disabled and not graphs.captured
    assert graphs.run(8, 1).shape == (8, 3)
    assert calls == [(4, 2), (8, 1)]  # eager from then on, one forward a step


def test_capturing_before_serving_writes_only_the_scratch_block(tiny_model_dir: Path) -> None:
    """Before any request, the captures' eager runs feed padding only (here the first capture fails,
    as it does without CUDA, and turns graphs off after that one eager run)."""
    engine = make_engine(tiny_model_dir, backend="torch")
    runner = engine.runner
    runner.backend = CudaBackend(runner.model, runner.device, runner.pool.keys.dtype)
    runner.decode_read = runner.backend.decode_read
    runner.graphs = DecodeGraphs(runner._decode_forward, runner.decode.buckets[-1])
    pool = runner.pool
    before = pool.keys.clone()
    assert runner.capture_decode_graphs() == 0 and runner.graphs.disabled
    changed = (pool.keys != before).any(dim=(0, 2, 3)).nonzero().flatten()
    assert len(changed) and all(int(slot) // pool.block_size == pool.scratch_block for slot in changed)
    assert engine.runner.decode.state.num_free == engine.runner.decode.state.scratch_row


def _outputs(engine: Engine, specs: list[AdmitSpec]) -> dict[str, list[int]]:
    arrivals: dict[int, list[AdmitSpec]] = {}
    for i, spec in enumerate(specs):
        arrivals.setdefault((i // 3) * 4, []).append(spec)  # three join every fourth step
    return run_to_end(engine, arrivals)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replays_give_the_eager_steps_tokens(tiny_model_dir: Path, dtype: str) -> None:
    """The replay runs the kernels the eager step runs, so the tokens are the same, one for one;
    in float32 they are also ``model.generate``'s (on the CPU, up to near-ties)."""
    specs = [admit(f"g{i}", p, 24) for i, p in enumerate(prompts(20, seed=5))]
    runs = {}
    for graphs in (True, False):
        engine = make_engine(tiny_model_dir, device="cuda", dtype=dtype, cuda_graphs=graphs, max_batch_size=32)
        assert engine.runner.backend.name == "cuda"
        runs[graphs] = _outputs(engine, specs)
        captured = engine.runner.graphs
        if graphs:
            assert captured is not None and not captured.disabled and captured.captured
        else:
            assert captured is None
    assert runs[True] == runs[False]
    if dtype == "float32":
        model = load_reference_model(tiny_model_dir)
        for spec in specs:
            ref = reference_greedy(model, list(spec.prompt_ids), spec.params.max_tokens)
            assert_matches_reference(runs[True][spec.request_id], ref, spec.request_id)

"""The CUDA backend's code, run on the CPU: its lean forward in plain torch ops with every decode
gathered into one batch is exact. (Selecting it needs a CUDA device; its forward needs none.)"""

from __future__ import annotations

from pathlib import Path

from executor_service.backends.base import DecodeRead
from executor_service.backends.cuda import CudaBackend
from tests.executor_service.test_engine import assert_staggered_batch_exact, make_engine


def test_the_cuda_backends_forward_matches_generate(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, backend="torch")  # plain nn.Linear layers, as on a GPU
    runner = engine.runner
    backend = CudaBackend(runner.model, runner.device, runner.pool.keys.dtype)
    assert backend.decode_read is DecodeRead.GATHERED
    backend.lean.native_layer_ops = False  # on CUDA the layer ops are never native (they are CPU C code)
    runner.backend, runner.decode_read = backend, backend.decode_read
    assert_staggered_batch_exact(engine, tiny_model_dir)

"""The CUDA backend's code, run on the CPU: its lean forward in plain torch ops with every decode
gathered into one batch, or read through whole block tables as its in-place kernel reads them, is
exact; the in-place reads are chosen only where the kernel may serve and passes its self-test.
(Selecting the backend needs a CUDA device; its forward needs none.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from executor_service import paged_decode
from executor_service.backends.base import DecodeRead
from executor_service.backends.cuda import CudaBackend
from executor_service.sliding_window import SlidingWindow
from tests.executor_service.test_engine import assert_staggered_batch_exact, make_engine


def test_the_cuda_backends_forward_matches_generate(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, backend="torch")  # plain nn.Linear layers, as on a GPU
    runner = engine.runner
    backend = CudaBackend(runner.model, runner.device, runner.pool.keys.dtype)
    assert backend.decode_read is DecodeRead.GATHERED
    backend.lean.native_layer_ops = False  # on CUDA the layer ops are never native (they are CPU C code)
    runner.backend, runner.decode_read = backend, backend.decode_read
    assert_staggered_batch_exact(engine, tiny_model_dir)


def test_decodes_are_gathered_where_the_in_place_kernel_cannot_serve(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, backend="torch")
    runner = engine.runner
    backend = CudaBackend(runner.model, runner.device, runner.pool.keys.dtype)
    backend.bind_kv(runner.pool, None)
    assert backend.decode_read is DecodeRead.GATHERED
    assert "in-place reads need float16 or bfloat16" in backend.describe()


def test_in_place_reads_are_chosen_only_past_their_self_test(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the kernel may serve, its self-test decides; with it passing, the CUDA backend's steps
    read whole tables and lengths (on the CPU, the kernel's gathered oracle computes them) exactly."""
    engine = make_engine(tiny_model_dir, backend="torch")
    runner = engine.runner
    backend = CudaBackend(runner.model, runner.device, runner.pool.keys.dtype)
    backend.lean.native_layer_ops = False
    monkeypatch.setattr(paged_decode, "unavailable", lambda *args: None)
    monkeypatch.setattr(paged_decode, "self_test", lambda *args: "differs from the gathered reads by 1")
    with caplog.at_level(logging.WARNING, logger="executor_service.backends.cuda"):
        backend.bind_kv(runner.pool, None)
    assert backend.decode_read is DecodeRead.GATHERED
    assert "failed their self-test: differs" in caplog.text and "failed their self-test" in backend.describe()
    monkeypatch.setattr(paged_decode, "self_test", lambda *args: None)
    backend.bind_kv(runner.pool, None)
    assert backend.decode_read is DecodeRead.PAGED and "paged in place" in backend.describe()
    backend.bind_kv(runner.pool, SlidingWindow(32, every_layer=True))  # no full-attention layer to read so
    assert backend.decode_read is DecodeRead.GATHERED and "every layer here is windowed" in backend.describe()
    backend.bind_kv(runner.pool, SlidingWindow(32, every_layer=False))  # its full-attention layers read in place
    assert backend.decode_read is DecodeRead.PAGED
    backend.bind_kv(runner.pool, None)
    runner.backend, runner.decode_read = backend, backend.decode_read
    assert_staggered_batch_exact(engine, tiny_model_dir)

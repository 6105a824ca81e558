"""The registry: per model family, device and dtype, the fastest backend whose declared support
covers it; a refusal naming what no backend (or the one asked for) computes."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

from executor_service.backends.base import BackendSupport
from executor_service.backends.registry import BACKENDS, backend_names, select_backend
from executor_service.backends.torch_reference import TorchBackend
from executor_service.model_support import ModelTraits, UnsupportedModel
from tests.executor_service.test_engine import make_engine

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU; nothing runs here
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

FAMILIES = {
    "llama": LlamaConfig(),
    "mistral": MistralConfig(sliding_window=None),
    "mistral-windowed": MistralConfig(sliding_window=512),
    "qwen2": Qwen2Config(),
    "qwen3": Qwen3Config(),
    "phi3": Phi3Config(),
    "llama-gelu": LlamaConfig(hidden_act="gelu"),
}


def _chosen(family: str, device: torch.device = CPU, dtype: torch.dtype = F32, requested: str = "auto") -> str:
    return select_backend(ModelTraits.from_config(FAMILIES[family]), device, dtype, requested).name


@pytest.mark.parametrize(
    ("family", "cpu", "cuda"),
    [
        ("llama", "cpu_native", "cuda"),
        ("mistral", "cpu_native", "cuda"),
        ("mistral-windowed", "cpu_native", "cuda"),  # the lean forward passes Mistral's window
        ("qwen2", "cpu_transformers", "torch"),
        ("qwen3", "cpu_transformers", "torch"),
        ("phi3", "cpu_transformers", "torch"),
        ("llama-gelu", "cpu_transformers", "torch"),  # the lean forward's MLP is SiLU's
    ],
)
def test_each_family_gets_the_fastest_backend_that_serves_it(family: str, cpu: str, cuda: str) -> None:
    assert _chosen(family, CPU, F32) == _chosen(family, CPU, BF16) == cpu
    assert _chosen(family, CUDA, BF16) == _chosen(family, CUDA, F16) == cuda


def test_a_dtype_the_native_paths_do_not_serve_takes_the_reference() -> None:
    assert _chosen("llama", CPU, F16) == "torch"


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_soft_capped_attention_takes_the_reference_and_is_refused_by_the_others(device: torch.device) -> None:
    gemma2 = ModelTraits.from_config(Gemma2Config())
    assert select_backend(gemma2, device, F32).name == "torch"  # the only one that soft-caps
    for name in backend_names():
        if name == "torch" or device.type not in next(b for b in BACKENDS if b.name == name).support.devices:
            continue
        with pytest.raises(UnsupportedModel, match=r"soft-caps its attention logits \(attn_logit_softcapping=50\)"):
            select_backend(gemma2, device, F32, requested=name)


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_attention_sinks_take_the_reference_and_are_refused_by_name_by_the_others(device: torch.device) -> None:
    sinky = ModelTraits.from_config(SimpleNamespace(model_type="sinky", attention_sinks=True, hidden_act="silu"))
    assert select_backend(sinky, device, F32).name == "torch"  # the only one that computes them
    for name in backend_names():
        if name == "torch" or device.type not in next(b for b in BACKENDS if b.name == name).support.devices:
            continue
        with pytest.raises(UnsupportedModel, match="the model uses attention sinks"):
            select_backend(sinky, device, F32, requested=name)


def test_a_model_refused_only_for_the_host_names_each_backends_reason() -> None:
    """No feature of the model is the problem here: the dtype is (no CPU backend runs float64)."""
    with pytest.raises(UnsupportedModel, match=r"no backend serves llama on cpu in float64") as refused:
        select_backend(ModelTraits.from_config(LlamaConfig()), CPU, torch.float64)
    assert "torch: dtype float64 (runs bfloat16, float16, float32)" in str(refused.value)


def test_the_override_picks_a_backend_that_serves_the_model() -> None:
    assert _chosen("llama", requested="torch") == "torch"
    assert _chosen("llama", requested="cpu_transformers") == "cpu_transformers"
    assert _chosen("qwen3", requested="torch") == "torch"


@pytest.mark.parametrize(
    ("family", "requested", "reason"),
    [
        ("qwen3", "cpu_native", "model type qwen3 (runs llama, mistral)"),
        ("llama", "cuda", "device cpu (runs on cuda)"),
    ],
)
def test_the_override_refuses_a_backend_that_cannot_serve_the_model(family: str, requested: str, reason: str) -> None:
    with pytest.raises(UnsupportedModel, match=rf"executor\.backend {requested} cannot serve .*{re.escape(reason)}"):
        _chosen(family, requested=requested)


def test_every_backend_computes_windows_and_a_support_without_them_names_the_window() -> None:
    """Each backend reads a windowed layer's window on every path it takes (test_sliding_window.py);
    a backend that declared full attention only would be passed over, saying why."""
    assert all(backend.support.sliding_window for backend in BACKENDS)
    windowed = ModelTraits.from_config(FAMILIES["mistral-windowed"])
    full_only = BackendSupport(devices=frozenset({"cpu"}), dtypes=frozenset({F32}))
    assert full_only.gaps(windowed, CPU, F32) == ("the model attends within a sliding window (512 tokens)",)


def test_an_unknown_backend_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="not one of auto, cpu_native, cpu_transformers, cuda, torch"):
        _chosen("llama", requested="tpu")


def test_the_registry_is_ordered_with_the_reference_last_and_cuda_only_on_cuda() -> None:
    assert len(set(backend_names())) == len(BACKENDS)
    assert BACKENDS[-1] is TorchBackend
    for backend in BACKENDS:
        if backend.name.startswith("cpu"):
            assert backend.support.devices == {"cpu"}
        elif backend.name == "cuda":
            assert backend.support.devices == {"cuda"}
        assert backend.support.attn_logit_softcapping == (backend is TorchBackend)
        assert backend.support.attention_sinks == (backend is TorchBackend)


def test_the_executor_refuses_at_load_a_backend_that_cannot_serve(tiny_model_dir: Path) -> None:
    with pytest.raises(UnsupportedModel, match=r"executor\.backend cuda cannot serve llama on cpu"):
        make_engine(tiny_model_dir, backend="cuda")
    with pytest.raises(ValueError, match="not one of"):
        make_engine(tiny_model_dir, backend="fastest")
    assert make_engine(tiny_model_dir, backend="torch").runner.backend.name == "torch"

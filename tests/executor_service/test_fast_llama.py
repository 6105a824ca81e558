"""The lean Llama forward: fused projections equal the separate ones; it applies only where it can."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from executor_service.fast_llama import FusedLinear, supports
from executor_service.kernels.small_gemm import torch_brgemm
from executor_service.packed_linear import PackedLinear, can_pack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_returns_each_layers_output(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(32, 48, bias=True), nn.Linear(32, 16, bias=False), nn.Linear(32, 8, bias=True)]
    layers = [layer.to(dtype) for layer in layers]
    fused = FusedLinear(layers)
    x = torch.randn(5, 32, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got, layer in zip(fused(x), layers, strict=True):
        torch.testing.assert_close(got, layer(x), atol=tolerance, rtol=tolerance)


def test_supports_llama_layouts_only(tiny_model_dir: Path) -> None:
    assert supports(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    small = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, hidden_act="gelu"
    )
    assert not supports(LlamaForCausalLM(small))
    gpt2 = nn.Module()
    gpt2.config = type("Config", (), {"model_type": "gpt2", "hidden_act": "gelu_new"})()
    assert not supports(gpt2)


def test_fused_linear_holds_no_weight_twice() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    plain = [nn.Linear(16, 8).half(), nn.Linear(16, 4).half()]  # float16 is never packed
    fused = FusedLinear(plain)
    assert plain[0].weight.data_ptr() == fused.weight.data_ptr(), "unpacked layers become views of the fused weight"
    assert plain[1].weight.data_ptr() == fused.weight[8:].data_ptr()
    if can_pack(torch.device("cpu"), torch.float32):
        packed = [PackedLinear(nn.Linear(16, 8)), PackedLinear(nn.Linear(16, 4))]
        expected = [layer(x) for layer in packed]
        FusedLinear(packed)
        assert all(layer.packed is None for layer in packed), "the fused packed copy replaces the layers' own"
        for layer, want in zip(packed, expected, strict=True):
            torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch_brgemm() is None, reason="no bf16 BRGeMM micro-kernel on this CPU")
def test_fused_bfloat16_layers_take_the_small_gemm_and_drop_their_own() -> None:
    torch.manual_seed(0)
    layers = [PackedLinear(nn.Linear(64, 96, bias=False).bfloat16()) for _ in range(3)]
    assert all(layer.small is not None for layer in layers)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    expected = [layer(x) for layer in layers]
    fused = FusedLinear(layers)
    assert fused.small is not None
    assert all(layer.small is None and layer.packed is None for layer in layers), "no weight held twice"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert fused.small.serves(x)
        for got, want in zip(fused(x), expected, strict=True):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    finally:
        torch.set_num_threads(before)

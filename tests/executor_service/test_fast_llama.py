"""The lean Llama forward's fused projections: they equal the separate ones and hold no weight twice."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torch import nn

from executor_service.fast_llama import FusedLinear
from executor_service.guarded_ops import GuardedOps
from executor_service.packed_linear import PackedLinear
from executor_service.torch_private import brgemm_bf16


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_returns_each_layers_output(dtype: torch.dtype, packed: bool) -> None:
    """``packed``: layers packed for oneDNN, where the guard allows it here; else plain ``nn.Linear``."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, 48, bias=True), nn.Linear(32, 16, bias=False), nn.Linear(32, 8)]
    layers = [layer.to(dtype) for layer in layers]
    if packed and GuardedOps.probe(torch.device("cpu"), dtype).packed_linear:
        layers = [PackedLinear(cast(nn.Linear, layer)) for layer in layers]
    fused = FusedLinear(layers)
    assert fused.packed == all(isinstance(layer, PackedLinear) for layer in layers)
    x = torch.randn(5, 32, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got, layer in zip(fused(x), layers, strict=True):
        torch.testing.assert_close(got, layer(x), atol=tolerance, rtol=tolerance)


def test_fused_linear_holds_no_weight_twice() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    plain = [nn.Linear(16, 8).half(), nn.Linear(16, 4).half()]  # float16 is never packed
    fused = FusedLinear(plain)
    assert plain[0].weight.data_ptr() == fused.weight.data_ptr(), "unpacked layers become views of the fused weight"
    assert plain[1].weight.data_ptr() == fused.weight[8:].data_ptr()
    if GuardedOps.probe(torch.device("cpu"), torch.float32).packed_linear:
        packed = [PackedLinear(nn.Linear(16, 8)), PackedLinear(nn.Linear(16, 4))]
        expected = [layer(x) for layer in packed]
        FusedLinear(packed)
        assert all(layer.packed is None for layer in packed), "the fused packed copy replaces the layers' own"
        for layer, want in zip(packed, expected, strict=True):
            torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(brgemm_bf16() is None, reason="no bf16 BRGeMM micro-kernel on this CPU")
def test_fused_bfloat16_layers_take_the_small_gemm_and_drop_their_own() -> None:
    torch.manual_seed(0)
    layers = [PackedLinear(nn.Linear(64, 96, bias=False).bfloat16(), small_gemm=True) for _ in range(3)]
    assert all(layer.small is not None for layer in layers)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    expected = [layer(x) for layer in layers]
    alone = PackedLinear(nn.Linear(64, 96, bias=False).bfloat16(), small_gemm=True)
    assert FusedLinear([alone]).small is None, "without small_gemm the fused layer keeps oneDNN"
    fused = FusedLinear(layers, small_gemm=True)
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

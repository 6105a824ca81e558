"""oneDNN-packed linear layers: same results as nn.Linear, swapped in only where they apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from executor_service.kernels import small_gemm
from executor_service.packed_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN linear"
)


def test_packed_linear_matches_linear_for_any_row_count() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=True)
    packed = PackedLinear(linear)
    for shape in [(1, 48), (1, 7, 48), (2, 64, 48)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert packed.weight is linear.weight, "the original weight stays the module's weight"


NATIVE_BF16 = can_pack(torch.device("cpu"), torch.bfloat16)


def test_pack_linears_swaps_float32_layers_and_bfloat16_ones_only_with_native_bf16() -> None:
    inner = nn.Sequential(nn.Linear(8, 8, bias=False))
    model = nn.Sequential(nn.Linear(8, 8), inner, nn.Linear(8, 8).bfloat16())
    assert pack_linears(model) == 2 + NATIVE_BF16
    assert isinstance(model[0], PackedLinear) and isinstance(inner[0], PackedLinear)
    if NATIVE_BF16:
        assert isinstance(model[2], PackedLinear)
    else:
        assert type(model[2]) is nn.Linear, "emulated bfloat16 stays with torch's own path"


def test_bfloat16_packs_only_where_the_cpu_has_native_bf16() -> None:
    assert torch.ops.mkldnn._is_mkldnn_bf16_supported() == NATIVE_BF16


@pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no native bf16: bfloat16 layers stay unpacked")
def test_packed_bfloat16_linear_matches_linear() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).bfloat16()
    packed = PackedLinear(linear)
    for shape in [(1, 64), (3, 7, 64), (65, 64)]:
        x = torch.randn(*shape, dtype=torch.bfloat16)
        torch.testing.assert_close(packed(x), linear(x), atol=2e-2, rtol=2e-2)


def test_without_the_micro_kernel_bfloat16_layers_keep_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch has no bf16 BRGeMM (no AMX or AVX512-BF16, another torch build), nothing changes."""
    monkeypatch.setattr(small_gemm, "torch_brgemm", lambda: None)
    weight = torch.zeros(64, 128, dtype=torch.bfloat16)
    assert small_gemm.SmallGemm.for_weight(weight, None) is None
    if NATIVE_BF16:
        assert PackedLinear(nn.Linear(128, 64, bias=False).bfloat16()).small is None

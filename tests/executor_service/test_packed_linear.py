"""oneDNN-packed linear layers: same results as nn.Linear, swapped in only where the guarded ops allow."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from executor_service import torch_private
from executor_service.guarded_ops import GuardedOps
from executor_service.packed_linear import PackedLinear, pack_linears

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not GuardedOps.probe(CPU, torch.float32).packed_linear, reason="this torch build has no usable oneDNN linear"
)


def test_packed_linear_matches_linear_for_any_row_count() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=True)
    packed = PackedLinear(linear)
    for shape in [(1, 48), (1, 7, 48), (2, 64, 48)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert packed.weight is linear.weight, "the original weight stays the module's weight"


def test_row_counts_are_rounded_to_few_shapes() -> None:
    rounded = [torch_private.onednn_rows(rows) for rows in range(1, 4097)]
    assert rounded[:16] == list(range(1, 17)), "up to 16 rows run as they are"
    assert all(r >= rows and r - rows < max(16, rows // 8) for rows, r in enumerate(rounded, 1))
    assert len(set(rounded)) < 80, "every step's row count maps to a few dozen compiled shapes"
    assert [torch_private.onednn_rows(n) for n in (17, 256, 257, 1024, 1025, 2048)] == [32, 256, 288, 1024, 1152, 2048]


@pytest.mark.parametrize("rows", [17, 100, 257, 1025])
def test_padded_rows_leave_every_real_row_as_linear_computes_it(rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(32, 40, bias=True)
    packed = PackedLinear(linear)
    x = torch.randn(1, rows, 32)
    got = packed(x)
    assert got.shape == (1, rows, 40)
    torch.testing.assert_close(got, linear(x), atol=1e-5, rtol=1e-5)


NATIVE_BF16 = GuardedOps.probe(CPU, torch.bfloat16).packed_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_linears_swaps_the_models_dtype_only_where_the_guard_allows(dtype: torch.dtype) -> None:
    inner = nn.Sequential(nn.Linear(8, 8, bias=False))
    model = nn.Sequential(nn.Linear(8, 8), inner, nn.Linear(8, 8).half()).to(dtype)
    model[2].half()  # another dtype than the model's: never packed
    ops = GuardedOps.probe(CPU, dtype)
    assert pack_linears(model, ops) == (2 if ops.packed_linear else 0)
    assert isinstance(model[0], PackedLinear) == ops.packed_linear
    assert isinstance(inner[0], PackedLinear) == ops.packed_linear
    assert type(model[2]) is nn.Linear
    if dtype == torch.bfloat16 and not NATIVE_BF16:
        assert type(model[0]) is nn.Linear, "emulated bfloat16 stays with torch's own path"


def test_public_ops_only_packs_nothing() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears(model, GuardedOps.probe(CPU, torch.float32, allowed=False)) == 0
    assert type(model[0]) is nn.Linear


def test_bfloat16_packs_only_where_the_cpu_has_native_bf16() -> None:
    assert torch_private.onednn_native_bf16() == NATIVE_BF16


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
    from executor_service.kernels import small_gemm

    monkeypatch.setattr(small_gemm, "brgemm_bf16", lambda: None)
    weight = torch.zeros(64, 128, dtype=torch.bfloat16)
    assert small_gemm.SmallGemm.for_weight(weight, None) is None
    if NATIVE_BF16:
        assert PackedLinear(nn.Linear(128, 64, bias=False).bfloat16(), small_gemm=True).small is None

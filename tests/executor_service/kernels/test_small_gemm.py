"""The bf16 small GEMM (torch's BRGeMM micro-kernel) against torch's linear, on real tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from executor_service.kernels.small_gemm import MAX_ROWS, MAX_WEIGHT_ELEMENTS, SmallGemm
from executor_service.packed_linear import PackedLinear
from executor_service.torch_private import brgemm_bf16

pytestmark = pytest.mark.skipif(brgemm_bf16() is None, reason="no bf16 BRGeMM micro-kernel on this CPU")

# The tiny model's q-k-v, o and down layers, a K that is not a multiple of the kernel's 32, and odd N.
SHAPES = [(512, 256), (256, 256), (256, 688), (40, 64), (24, 34)]


def _bf16_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, MAX_ROWS])
def test_small_gemm_matches_linear_within_bf16_rounding(out_features: int, in_features: int, rows: int) -> None:
    weight = _bf16_weight(out_features, in_features)
    x = torch.randn(rows, in_features).bfloat16()
    got = SmallGemm(weight)(x)
    exact = x.float() @ weight.float().t()  # the float32 product of the same bf16 inputs
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # One bf16 rounding of a float32 sum: within half a bf16 ulp of it, plus float32 reordering.
    torch.testing.assert_close(got.float(), exact, atol=1e-4, rtol=2**-8)
    torch.testing.assert_close(got, F.linear(x, weight), atol=2e-2, rtol=2e-2)


def test_each_row_is_the_same_whatever_the_batch_it_is_in() -> None:
    """Whole tiles of 16 rows and the rest go through different kernels; a row's result may not
    depend on which, or greedy decoding of a request would depend on the others in its batch."""
    weight = _bf16_weight(256, 256)
    gemm = SmallGemm(weight)
    x = torch.randn(MAX_ROWS, 256).bfloat16()
    batched = gemm(x)
    for row in (0, 15, 16, 40, MAX_ROWS - 1):
        assert torch.equal(gemm(x[row : row + 1]), batched[row : row + 1])
    assert torch.equal(gemm(x[:37]), batched[:37])


def test_results_stay_right_when_onednn_uses_the_tiles_in_between() -> None:
    """oneDNN's own AMX primitives reconfigure the tiles between our calls (prefill, lm_head)."""
    weight, other = _bf16_weight(256, 256), nn.Linear(688, 1376, bias=False).bfloat16()
    gemm, packed_other = SmallGemm(weight), PackedLinear(other)
    x = torch.randn(32, 256).bfloat16()
    first = gemm(x)
    for rows in (100, 7, 300):
        packed_other.small = None  # force oneDNN for the layer in between
        packed_other(torch.randn(rows, 688).bfloat16())
        assert torch.equal(gemm(x), first)
        assert torch.equal(gemm(x[:3]), first[:3])


def test_input_with_a_row_stride_and_an_empty_batch() -> None:
    weight = _bf16_weight(64, 128)
    gemm = SmallGemm(weight)
    wide = torch.randn(9, 200).bfloat16()
    x = wide[:, 10:138]  # rows 200 apart
    assert torch.equal(gemm(x), gemm(x.contiguous()))
    assert gemm(torch.empty(0, 128, dtype=torch.bfloat16)).shape == (0, 64)


def test_wrong_inputs_are_refused() -> None:
    gemm = SmallGemm(_bf16_weight(64, 128))
    for bad in (
        torch.randn(4, 127).bfloat16(),  # wrong width
        torch.randn(4, 128),  # float32
        torch.randn(MAX_ROWS + 1, 128).bfloat16(),  # too many rows
        torch.randn(128, 4).bfloat16().t(),  # columns not contiguous
    ):
        with pytest.raises(ValueError):
            gemm(bad)


def test_which_layers_it_takes() -> None:
    assert SmallGemm.for_weight(_bf16_weight(64, 128), None) is not None
    assert SmallGemm.for_weight(_bf16_weight(64, 128).float(), None) is None  # float32: oneDNN
    assert SmallGemm.for_weight(_bf16_weight(64, 128), torch.zeros(64, dtype=torch.bfloat16)) is None  # bias
    assert SmallGemm.for_weight(_bf16_weight(64, 127), None) is None  # odd K: no VNNI pairs
    side = int(MAX_WEIGHT_ELEMENTS**0.5)
    assert SmallGemm.for_weight(_bf16_weight(side, side), None) is not None
    assert SmallGemm.for_weight(_bf16_weight(side * 2, side), None) is None  # too large: oneDNN streams it better


def test_serves_decode_sizes_on_one_thread_only() -> None:
    gemm = SmallGemm(_bf16_weight(64, 128))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert gemm.serves(torch.empty(MAX_ROWS, 128, dtype=torch.bfloat16))
        assert not gemm.serves(torch.empty(MAX_ROWS + 1, 128, dtype=torch.bfloat16))
        assert not gemm.serves(torch.empty(1, 3, 128, dtype=torch.bfloat16))
        torch.set_num_threads(2)
        assert not gemm.serves(torch.empty(4, 128, dtype=torch.bfloat16))
    finally:
        torch.set_num_threads(before)


def test_packed_linear_uses_it_for_decode_rows_and_onednn_otherwise() -> None:
    linear = nn.Linear(256, 256, bias=False).bfloat16()
    packed = PackedLinear(linear, small_gemm=True)
    assert packed.small is not None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for rows in (3, MAX_ROWS, MAX_ROWS + 9):
            x = torch.randn(rows, 256).bfloat16()
            torch.testing.assert_close(packed(x), linear(x), atol=2e-2, rtol=2e-2)
    finally:
        torch.set_num_threads(before)

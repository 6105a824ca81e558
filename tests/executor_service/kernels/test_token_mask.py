"""The native token-bitmask kernel gives xgrammar's CPU kernel's logits, bit for bit, on every kind
of word (all set, all clear, mixed, bit 31), partial last words, row subsets and narrower coverage;
and it refuses what its C code cannot read."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from executor_service.kernels import token_mask

pytestmark = pytest.mark.skipif(not token_mask.available(), reason="no C compiler to build the kernel")


def bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    masks = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    masks[0] = -1  # every token allowed
    masks[1] = 0  # none
    masks[2] = 0
    masks[2, words // 2] = -(2**31)  # only bit 31 of one word
    masks[3, ::2] = -1  # whole words either way beside mixed ones
    masks[3, 1::4] = 0
    return masks


@pytest.mark.parametrize(("width", "covered"), [(8192, 8192), (1000, 1000), (1030, 1000), (800, 790)])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [5, 2, 0], []])
def test_matches_xgrammars_kernel(width: int, covered: int, rows: list[int]) -> None:
    words = (covered + 31) // 32
    masks = bitmask(6, words, seed=width + covered)
    logits = torch.randn(6, width, generator=torch.Generator().manual_seed(1))
    expected = logits.clone()
    if rows:
        xgr.apply_token_bitmask_inplace(expected, masks, vocab_size=covered, indices=rows)
    token_mask.apply_token_bitmask(logits, masks, rows, covered)
    assert torch.equal(logits, expected)


def test_rows_with_a_stride_are_masked_in_place() -> None:
    wide = torch.zeros(2, 96)
    view = wide[:, 16:80]  # rows 96 floats apart
    masks = torch.tensor([[1, 0], [0, -1]], dtype=torch.int32)
    token_mask.apply_token_bitmask(view, masks, [0, 1], 64)
    assert [i for i in range(64) if view[0, i] == 0] == [0] and [i for i in range(64) if view[1, i] == 0] == list(
        range(32, 64)
    )
    assert bool((wide[:, :16] == 0).all()) and bool((wide[:, 80:] == 0).all())


def test_refuses_what_it_cannot_read() -> None:
    masks = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="float32"):
        token_mask.apply_token_bitmask(torch.zeros(2, 64, dtype=torch.bfloat16), masks, [0], 64)
    with pytest.raises(ValueError, match="int32"):
        token_mask.apply_token_bitmask(torch.zeros(2, 64), masks.long(), [0], 64)
    with pytest.raises(ValueError, match="width"):
        token_mask.apply_token_bitmask(torch.zeros(2, 64), masks, [0], 65)
    with pytest.raises(ValueError, match="outside"):
        token_mask.apply_token_bitmask(torch.zeros(2, 64), masks, [2], 64)

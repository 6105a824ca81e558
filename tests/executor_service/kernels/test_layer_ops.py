"""The native layer ops against transformers' own formulation: RoPE and the residual add bit for bit,
RMSNorm and SiLU within an ulp or two, argmax exactly (ties, NaN, strided rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from executor_service import kernels
from executor_service.kernels import layer_ops

pytestmark = pytest.mark.skipif(
    not layer_ops.available(torch.device("cpu"), torch.float32), reason="no C compiler here"
)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("dim", [256, 250])
def test_add_rms_norm_matches_llama_rmsnorm(rows: int, dim: int) -> None:
    torch.manual_seed(rows + dim)
    hidden, delta = torch.randn(rows, dim), torch.randn(rows, dim)
    norm = LlamaRMSNorm(dim, eps=1e-5)
    norm.weight.data = torch.randn(dim)
    expected_hidden = hidden + delta
    got = layer_ops.add_rms_norm(hidden, delta, norm.weight.data, 1e-5)
    assert torch.equal(hidden, expected_hidden), "the residual add rounds like torch's"
    torch.testing.assert_close(got, norm(expected_hidden), rtol=1e-6, atol=1e-6)
    before = hidden.clone()
    torch.testing.assert_close(layer_ops.add_rms_norm(hidden, None, norm.weight.data, 1e-5), norm(before))
    assert torch.equal(hidden, before), "no delta: hidden is left alone"


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (3, 3, 32), (8, 1, 128)])
def test_rope_store_matches_apply_rotary_pos_emb_bit_for_bit(heads: int, kv_heads: int, dim: int) -> None:
    torch.manual_seed(heads)
    rows = 19
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim + 8)[:, : (heads + 2 * kv_heads) * dim]  # strided rows
    cos, sin = torch.randn(rows, dim), torch.randn(rows, dim)
    q = qkv[:, : heads * dim].reshape(rows, heads, dim).transpose(0, 1)[None]
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(rows, kv_heads, dim).transpose(0, 1)[None]
    v = qkv[:, (heads + kv_heads) * dim :].reshape(rows, kv_heads, dim)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    keys, values = torch.zeros(50, kv_heads, dim), torch.zeros(50, kv_heads, dim)
    slots = torch.randperm(50)[:rows].contiguous()
    layer_ops.rope_store(qkv, cos, sin, heads, kv_heads, keys, values, slots)
    assert torch.equal(qkv[:, : heads * dim].reshape(rows, heads, dim), want_q[0].transpose(0, 1))
    assert torch.equal(keys[slots], want_k[0].transpose(0, 1))
    assert torch.equal(values[slots], v)
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[slots] = False
    assert not keys[untouched].any() and not values[untouched].any(), "only the rows' own slots are written"


def test_silu_mul_matches_torch_within_an_ulp_or_two() -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(33, 2 * 691) * 6  # an odd width: the vector loop and the scalar tail
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])
    got = layer_ops.silu_mul(gate_up)
    want = F.silu(gate_up[:, :691]) * gate_up[:, 691:]
    torch.testing.assert_close(got, want, rtol=5e-7, atol=1e-30)


BF16 = torch.bfloat16


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """The largest distance between the two in bfloat16 steps (their bit patterns as integers)."""
    a, b = got.view(torch.int16).int(), want.view(torch.int16).int()
    return int((a - b).abs().max())


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_bfloat16_add_rms_norm_matches_llama_rmsnorm_within_a_bf16_ulp(rows: int) -> None:
    torch.manual_seed(rows)
    dim = 250  # the vector loop and its tail
    hidden, delta = torch.randn(rows, dim, dtype=BF16), torch.randn(rows, dim, dtype=BF16)
    norm = LlamaRMSNorm(dim, eps=1e-5).to(BF16)
    norm.weight.data = torch.randn(dim, dtype=BF16)
    expected_hidden = hidden + delta
    got = layer_ops.add_rms_norm(hidden, delta, norm.weight.data, 1e-5)
    assert torch.equal(hidden, expected_hidden), "the residual add rounds like torch's"
    assert got.dtype == BF16 and bf16_ulps(got, norm(expected_hidden)) <= 1


def test_bfloat16_rope_store_matches_apply_rotary_pos_emb_bit_for_bit() -> None:
    torch.manual_seed(1)
    rows, heads, kv_heads, dim = 19, 4, 2, 64
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(rows, width + 8, dtype=BF16)[:, :width]
    cos, sin = torch.randn(rows, dim, dtype=BF16), torch.randn(rows, dim, dtype=BF16)
    q = qkv[:, : heads * dim].reshape(rows, heads, dim).transpose(0, 1)[None]
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(rows, kv_heads, dim).transpose(0, 1)[None]
    v = qkv[:, (heads + kv_heads) * dim :].reshape(rows, kv_heads, dim).clone()
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    keys, values = torch.zeros(50, kv_heads, dim, dtype=BF16), torch.zeros(50, kv_heads, dim, dtype=BF16)
    slots = torch.randperm(50)[:rows].contiguous()
    layer_ops.rope_store(qkv, cos, sin, heads, kv_heads, keys, values, slots)
    assert torch.equal(qkv[:, : heads * dim].reshape(rows, heads, dim), want_q[0].transpose(0, 1))
    assert torch.equal(keys[slots], want_k[0].transpose(0, 1))
    assert torch.equal(values[slots], v)


def test_bfloat16_silu_mul_matches_torch_within_a_bf16_ulp() -> None:
    torch.manual_seed(0)
    gate_up = (torch.randn(33, 2 * 691) * 6).to(BF16)  # an odd width: the chunks and the tail
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])
    got = layer_ops.silu_mul(gate_up)
    want = F.silu(gate_up[:, :691]) * gate_up[:, 691:]
    # One bf16 step relative (2^-7); silu(-100) is -4e-37 here and -0 in torch (exp(100) = inf there).
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_equals_torch_argmax(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(14, 8192 + 16).to(dtype)[:, :8192]  # strided rows
    logits[1, 100] = float("nan")
    logits[1, 5000] = float("nan")
    logits[2, 8191] = float("nan")
    logits[3] = 1.0  # all equal: the first index
    logits[4, 7000:] = 50.0  # a tie across vector lanes
    logits[5] = float("-inf")
    logits[6, 3] = logits[6].max() + 1
    logits[6, 4] = logits[6, 3]
    logits[7, 100] = logits[7, 6000] = 60.0  # bfloat16 widens a chunk at a time: a tie across chunks
    logits[8, 5000] = 70.0  # the maximum past the first chunk
    logits[9, 10] = 80.0
    logits[9, 3000] = float("nan")  # a NaN past the first chunk still wins
    assert torch.equal(layer_ops.argmax_rows(logits), logits.argmax(dim=-1))
    for cols in (1, 2, 8, 15, 16, 17, 31, 33, 2047, 2048, 2049):
        small = torch.randn(5, cols).to(dtype)
        assert torch.equal(layer_ops.argmax_rows(small), small.argmax(dim=-1)), cols


def test_checks_refuse_what_the_c_code_cannot_read() -> None:
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        layer_ops.silu_mul(torch.randn(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="weight must be bfloat16"):
        layer_ops.add_rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        layer_ops.argmax_rows(torch.randn(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        layer_ops.add_rms_norm(torch.randn(8, 4).t(), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="slots"):
        layer_ops.rope_store(
            torch.randn(3, 4 * 8), torch.randn(3, 8), torch.randn(3, 8), 2, 1, torch.zeros(9, 1, 8),
            torch.zeros(9, 1, 8), torch.zeros(3, dtype=torch.int32),
        )  # fmt: skip


def test_without_a_compiler_the_layer_ops_are_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("BATON_KERNEL_CACHE", str(tmp_path / "cache"))
    kernels.layer_ops_library.cache_clear()
    try:
        assert not layer_ops.available(torch.device("cpu"), torch.float32)
    finally:
        kernels.layer_ops_library.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_large_calls_split_rows_between_threads_with_the_same_results(dtype: torch.dtype) -> None:
    """A prefill-sized call (past the C code's PARALLEL_VALUES) gives bit for bit what one thread gives."""
    torch.manual_seed(3)
    rows, heads, kv_heads, dim, inter = 300, 4, 2, 64, 691
    width = (heads + 2 * kv_heads) * dim
    hidden, delta = torch.randn(rows, 256).to(dtype), torch.randn(rows, 256).to(dtype)
    weight = torch.randn(256).to(dtype)
    qkv = torch.randn(rows, width).to(dtype)
    cos, sin = torch.randn(rows, dim).to(dtype), torch.randn(rows, dim).to(dtype)
    slots = torch.randperm(400)[:rows].contiguous()
    gate_up = (torch.randn(rows, 2 * inter) * 6).to(dtype)
    results = []
    previous = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            h, q = hidden.clone(), qkv.clone()
            keys, values = torch.zeros(400, kv_heads, dim, dtype=dtype), torch.zeros(400, kv_heads, dim, dtype=dtype)
            normed = layer_ops.add_rms_norm(h, delta, weight, 1e-6)
            layer_ops.rope_store(q, cos, sin, heads, kv_heads, keys, values, slots)
            results.append((h, normed, q, keys, values, layer_ops.silu_mul(gate_up)))
        finally:
            torch.set_num_threads(previous)
    for one, two in zip(*results, strict=True):
        assert torch.equal(one, two)

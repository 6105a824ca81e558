"""The native paged prefill-attention kernel against causal attention in float64 on the same keys."""

from __future__ import annotations

import ctypes
import random
from pathlib import Path

import pytest
import torch

from executor_service import kernels
from executor_service.kernels.prefill_attention import PagedPrefills, available, prefill_attention

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(
    not available(CPU, torch.float32, 64), reason="the prefill kernel needs AVX-512, or AVX2 and FMA"
)
DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(not available(CPU, torch.bfloat16, 64), reason="bfloat16 needs AVX512-BF16"),
    ),
]
# bfloat16 output: within half a unit in the last place of values about 1 in size
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3}

BLOCK = 16


def pool(
    slots: int, kv_heads: int, dim: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    values = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    return keys, values


def tables_for(ends: list[int], num_blocks: int, rng: random.Random) -> list[list[int]]:
    free = list(range(num_blocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-end // BLOCK))] for end in ends]


def reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row: int, start: int, count: int, table: list[int]
) -> torch.Tensor:
    """[count, H, d]: each query at position start + i attends to keys 0 .. start + i, in float64."""
    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[3]
    slots = torch.tensor([table[t // BLOCK] * BLOCK + t % BLOCK for t in range(start + count)])
    k = keys[slots].double().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [H, L, d]
    v = values[slots].double().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    q = query[0, :, row : row + count].double()  # [H, count, d]
    scores = q @ k.transpose(1, 2) * dim**-0.5
    future = torch.arange(start + count)[None] > torch.arange(start, start + count)[:, None]
    return (scores.masked_fill(future, float("-inf")).softmax(-1) @ v).transpose(0, 1)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (12, 12)])  # the tiny and small models' heads
def test_matches_causal_attention_over_the_pool(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    # (start, count): a fresh prompt, chunks after cached tokens ending and starting mid-block, one
    # query, and a chunk longer than several tiles of sixteen.
    chunks = [(0, 37), (400, 40), (10, 1), (17, 100), (48, 16)]
    rng = random.Random(0)
    tables = tables_for([s + c for s, c in chunks], 200, rng)
    keys, values = pool(200 * BLOCK, kv_heads, 64, dtype)
    rows = [sum(c for _, c in chunks[:i]) for i in range(len(chunks))]
    total = sum(c for _, c in chunks)
    query = torch.randn(1, heads, total, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.empty(total, heads, 64, dtype=dtype)
    prefills = PagedPrefills.build(rows, [c for _, c in chunks], [s for s, _ in chunks], tables)
    prefill_attention(query, keys, values, prefills, BLOCK, 64**-0.5, out)
    for (start, count), row, table in zip(chunks, rows, tables, strict=True):
        expected = reference(query, keys, values, row, start, count, table)
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(out[row : row + count].double(), expected, atol=tolerance, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_gets_the_same_bits_however_its_prompt_is_chunked(dtype: torch.dtype) -> None:
    """Each query's sums run in its own lane, in key order: splitting a prompt into chunks, or
    sharing the call with other chunks, changes none of its output bits."""
    heads, kv_heads, count = 12, 12, 100
    rng = random.Random(2)
    table, other = tables_for([17 + count, 300], 100, rng)
    keys, values = pool(100 * BLOCK, kv_heads, 64, dtype, seed=3)
    query = torch.randn(1, heads, count, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    whole = torch.empty(count, heads, 64, dtype=dtype)
    prefill_attention(query, keys, values, PagedPrefills.build([0], [count], [17], [table]), BLOCK, 0.125, whole)
    # the same queries as chunks of 50, 7 and 43, with a chunk of another prompt between them
    mixed = torch.cat([query[:, :, :50], torch.randn(1, heads, 20, 64).to(dtype), query[:, :, 50:]], dim=2)
    split = torch.empty(count + 20, heads, 64, dtype=dtype)
    prefills = PagedPrefills.build([0, 50, 70, 77], [50, 20, 7, 43], [17, 280, 67, 74], [table, other, table, table])
    prefill_attention(mixed, keys, values, prefills, BLOCK, 0.125, split)
    assert torch.equal(torch.cat([split[:50], split[70:]]), whole)


@needs_kernel
def test_refuses_what_it_cannot_serve() -> None:
    keys, values = pool(4 * BLOCK, 2, 64, torch.float32)
    prefills = PagedPrefills.build([0], [4], [0], [[0]])
    with pytest.raises(ValueError, match="query's dtype"):
        prefill_attention(torch.randn(1, 4, 4, 64), keys, values, prefills, BLOCK, 0.125, torch.empty(4, 4, 64).half())
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        prefill_attention(torch.randn(1, 4, 4, 64).half(), keys, values, prefills, BLOCK, 0.125, torch.empty(4, 4, 64))
    assert not available(CPU, torch.float16, 64)
    assert not available(CPU, torch.float32, 80)  # head_dim not a multiple of 64


@pytest.mark.parametrize(
    ("cpu_flag", "flags", "serves"),
    [
        ("avx512_bf16", ("-mno-avx512bf16",), {0: 1, 1: 0}),
        ("avx512f", ("-mno-avx512f",), {0: 1, 1: 0}),  # AVX2 and FMA: float32
        ("avx2", ("-mno-avx2",), {0: 0, 1: 0}),  # (which drops AVX-512 with it)
    ],
)
def test_narrower_builds_decline_what_they_cannot_compute(
    cpu_flag: str, flags: tuple[str, ...], serves: dict[int, int]
) -> None:
    """A build without AVX512-BF16 serves float32 pools only, and so does one without AVX-512 (on
    AVX2 and FMA); one without AVX2 serves neither. Each still builds and says so, and the runner
    keeps the SDPA path for what it declines."""
    if cpu_flag not in Path("/proc/cpuinfo").read_text():
        pytest.skip(f"this CPU's own build already does without {cpu_flag}")
    try:
        library = ctypes.CDLL(str(kernels.build(kernels.PREFILL_ATTENTION_SOURCE, flags)))
    except OSError as exc:
        pytest.skip(f"no such build here: {exc}")
    for is_bf16, expected in serves.items():
        assert library.baton_prefill_attention_supported(ctypes.c_int64(64), ctypes.c_int(is_bf16)) == expected

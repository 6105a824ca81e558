"""The native paged decode-attention kernel against torch SDPA on the same contexts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from executor_service import kernels
from executor_service.kernels import decode_attention as decode_attention_module
from executor_service.kernels.decode_attention import PagedDecodes, available, decode_attention

# Builds for CPUs with less than this one: (the CPU flag that build leaves out, the compiler flags).
NARROWER_BUILDS = {
    "without-avx512-bf16": ("avx512_bf16", ("-mno-avx512bf16",)),  # in place, rows widened in pairs
    "without-avx512": ("avx512f", ("-mno-avx512f",)),  # AVX2: a bfloat16 pool staged through float32
}


@pytest.fixture(params=["native", *NARROWER_BUILDS])
def kernel_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kernel as this CPU builds it, and as CPUs with fewer vector instructions build it: every
    path that reads a bfloat16 pool is checked on a CPU that has them all."""
    if request.param in NARROWER_BUILDS:
        cpu_flag, flags = NARROWER_BUILDS[request.param]
        if cpu_flag not in Path("/proc/cpuinfo").read_text():
            pytest.skip(f"this CPU's own build already does without {cpu_flag}")
        try:
            library = kernels.load_decode_attention(kernels.build(extra_flags=flags))
        except OSError as exc:
            pytest.skip(f"no build {request.param} here: {exc}")
        monkeypatch.setattr(decode_attention_module, "decode_attention_library", lambda: library)
    return str(request.param)


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: list[torch.Tensor]) -> torch.Tensor:
    """SDPA per request over its gathered context, GQA by repeating K/V: [D, H, d] in float32."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    outs = []
    for i, context in enumerate(slots):
        q = query[0, :, i].float()[None, :, None]  # [1, H, 1, d]
        k = keys[context].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)[None]
        v = values[context].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)[None]
        outs.append(F.scaled_dot_product_attention(q, k, v)[0, :, 0])
    return torch.stack(outs)


def scattered_tables(lengths: list[int], block_size: int, num_blocks: int, rng: random.Random) -> list[list[int]]:
    free = list(range(num_blocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "dtype"),
    [
        (4, 2, 64, 16, torch.float32),  # the tiny model's shape
        (12, 12, 64, 16, torch.float32),  # no GQA
        (8, 2, 128, 16, torch.float32),  # two 64-wide tiles
        (6, 3, 80, 5, torch.float32),  # a head dim and block size off the vector widths
        (4, 1, 32, 16, torch.float32),
        (4, 2, 64, 16, torch.bfloat16),  # staged through float32 (an 8 KB block)
        (12, 12, 64, 16, torch.bfloat16),  # the small model's: read in place where the CPU has AVX-512
        (16, 4, 128, 16, torch.bfloat16),  # in place, two 64-wide tiles
        (6, 3, 80, 5, torch.bfloat16),
    ],
)
def test_matches_sdpa_over_scattered_blocks(
    heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype, kernel_build: str
) -> None:
    if not available(torch.device("cpu"), dtype):
        pytest.skip("no C compiler here")
    rng = random.Random(heads * dim + block_size)
    torch.manual_seed(0)
    lengths = [1, 7, 8, 9, 33, 200, rng.randrange(1, 300)]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 8
    keys = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    values = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    tables = scattered_tables(lengths, block_size, num_blocks, rng)
    # Query rows as transformers hands them over: [1, H, N, d], a transposed view.
    rows = [3 * i + 1 for i in range(len(lengths))]
    packed = torch.randn(1, max(rows) + 1, heads, dim).to(dtype).transpose(1, 2)
    out = torch.full((packed.shape[2], heads, dim), float("nan"), dtype=dtype)
    decode_attention(packed, keys, values, PagedDecodes.build(rows, lengths, tables), block_size, dim**-0.5, out)

    slots = [
        torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(n)])
        for table, n in zip(tables, lengths, strict=True)
    ]
    expected = reference(packed[:, :, rows], keys, values, slots)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[rows].float(), expected, atol=tolerance, rtol=tolerance)
    untouched = [r for r in range(out.shape[0]) if r not in rows]
    assert torch.isnan(out[untouched]).all(), "rows other than the decodes' were written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "block_size"), [(1, 16), (16, 16), (17, 16), (5, 5), (40, 16)])
def test_a_sliding_window_reads_only_the_last_window_tokens(window: int, block_size: int, dtype: torch.dtype) -> None:
    """Each decode reads its last ``window`` tokens, from inside a block; the table entries of blocks
    wholly before them point at a block of NaNs (as released blocks' placeholders could point
    anywhere): the output stays finite only if the kernel never reads them."""
    if not available(torch.device("cpu"), dtype):
        pytest.skip("no C compiler here")
    heads, kv_heads, dim = (12, 12, 64) if dtype == torch.bfloat16 else (4, 2, 64)
    rng = random.Random(window * block_size)
    torch.manual_seed(1)
    lengths = [1, window, window + 1, 2 * block_size + 3, 150, rng.randrange(1, 200)]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    keys = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    values = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    poisoned = num_blocks - 1
    keys[poisoned * block_size :] = float("nan")
    values[poisoned * block_size :] = float("nan")
    tables = scattered_tables(lengths, block_size, num_blocks - 1, rng)
    firsts = [max(0, n - window) for n in lengths]
    for table, first in zip(tables, firsts, strict=True):
        table[: first // block_size] = [poisoned] * (first // block_size)
    rows = list(range(len(lengths)))
    query = torch.randn(1, heads, len(lengths), dim).to(dtype)
    out = torch.empty(len(lengths), heads, dim, dtype=dtype)
    decodes = PagedDecodes.build(rows, lengths, tables)
    decode_attention(query, keys, values, decodes, block_size, dim**-0.5, out, window=window)

    slots = [
        torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(first, n)])
        for table, first, n in zip(tables, firsts, lengths, strict=True)
    ]
    expected = reference(query, keys, values, slots)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_rejects_a_pool_in_another_dtype() -> None:
    if not available(torch.device("cpu"), torch.float32):
        pytest.skip("no C compiler here")
    query = torch.randn(1, 2, 1, 8)
    pool = torch.randn(16, 2, 8, dtype=torch.bfloat16)
    decodes = PagedDecodes.build([0], [3], [[0]])
    with pytest.raises(ValueError, match="keys"):
        decode_attention(query, pool, pool, decodes, 16, 1.0, torch.empty(1, 2, 8))


def test_build_caches_by_source_and_reports_compiler_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not available(torch.device("cpu"), torch.float32):
        pytest.skip("no C compiler here")
    monkeypatch.setenv("BATON_KERNEL_CACHE", str(tmp_path / "cache"))
    good = tmp_path / "ok.c"
    good.write_text("int answer(void) { return 42; }\n")
    first = kernels.build(good)
    assert first.exists() and kernels.build(good) == first
    good.write_text("int answer(void) { return 43; }\n")
    assert kernels.build(good) != first, "a changed source must not reuse the old library"
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    with pytest.raises(OSError, match="failed"):
        kernels.build(bad)
    assert not list((tmp_path / "cache").glob("*.partial")), "a failed build left a partial file"


def test_without_a_compiler_the_engine_keeps_the_torch_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("BATON_KERNEL_CACHE", str(tmp_path / "cache"))
    kernels.decode_attention_library.cache_clear()
    try:
        assert not available(torch.device("cpu"), torch.float32)
    finally:
        kernels.decode_attention_library.cache_clear()


def shared_prefix_tables(block_size: int, rng: random.Random) -> tuple[list[int], list[list[int]], int]:
    """Decodes as a prefix cache lays them out: groups whose tables begin with the same blocks (one of
    them sharing a shorter run with part of its group, one ending exactly on its shared blocks), a
    group of one, and decodes with no full block; returns lengths, tables and the pool's block count."""
    free = list(range(400))
    rng.shuffle(free)
    lengths: list[int] = []
    tables: list[list[int]] = []

    def add(prefix: list[int], length: int) -> None:
        own = -(-length // block_size) - len(prefix)
        lengths.append(length)
        tables.append(prefix + [free.pop() for _ in range(own)])

    system = [free.pop() for _ in range(5)]
    for extra in (1, 9, block_size, 3 * block_size + 2, 0):
        add(system, 5 * block_size + extra)  # 0: ends exactly where the shared blocks end
    add(system[:2], 2 * block_size + 7)  # shares only the first two of them
    other = [free.pop() for _ in range(3)]
    for extra in (4, 20):
        add(other, 3 * block_size + extra)
    add([free.pop()], block_size + 3)  # alone on its first block
    add([], block_size - 1)  # no full block
    add([], 1)
    order = list(range(len(lengths)))
    rng.shuffle(order)  # the step's order mixes the groups
    return [lengths[i] for i in order], [tables[i] for i in order], 400


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "dtype"),
    [
        (4, 2, 64, 16, torch.float32),
        (4, 2, 64, 16, torch.bfloat16),  # staged once for the group
        (12, 12, 64, 16, torch.bfloat16),  # read in place where the CPU has AVX-512
        (6, 3, 80, 5, torch.float32),
    ],
)
def test_decodes_on_one_prefix_read_it_together_with_the_same_outputs(
    heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype, threads: int, kernel_build: str
) -> None:
    """Decodes whose tables begin with the same blocks are attended together (each shared block read
    once for all): every output is bit for bit what the decode computes alone, and matches SDPA."""
    if not available(torch.device("cpu"), dtype):
        pytest.skip("no C compiler here")
    rng = random.Random(heads + dim + threads)
    torch.manual_seed(2)
    lengths, tables, num_blocks = shared_prefix_tables(block_size, rng)
    keys = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    values = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    rows = list(range(len(lengths)))
    query = torch.randn(1, heads, len(lengths), dim).to(dtype)
    decodes = PagedDecodes.build(rows, lengths, tables)
    together = torch.empty(len(lengths), heads, dim, dtype=dtype)
    alone = torch.empty_like(together)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        decode_attention(query, keys, values, decodes, block_size, dim**-0.5, together)
        decode_attention(query, keys, values, decodes, block_size, dim**-0.5, alone, share=False)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, alone), "reading a shared prefix together changed some output"
    one_by_one = torch.empty_like(together)
    for i in rows:  # each decode in a call of its own: nothing to share
        single = PagedDecodes.build([0], [lengths[i]], [tables[i]])
        decode_attention(query[:, :, i : i + 1], keys, values, single, block_size, dim**-0.5, one_by_one[i : i + 1])
    assert torch.equal(together, one_by_one)
    slots = [
        torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(n)])
        for table, n in zip(tables, lengths, strict=True)
    ]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.float(), reference(query, keys, values, slots), atol=tolerance, rtol=tolerance)

"""In-place paged decode reads (``paged_decode``): when the kernel may serve, the gathered oracle
against one SDPA call per request, the self-test catching a wrong kernel, and on CUDA the kernel itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_service import paged_decode
from executor_service.paged_decode import PagedGroup, attend_paged, gathered_reference, self_test, unavailable

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")  # a name only: unavailable() checks dtype, blocks and heads before the device


@pytest.mark.parametrize(
    ("device", "dtype", "block_size", "head_dim", "reason"),
    [
        (CUDA, torch.float32, 256, 64, "float16 or bfloat16"),
        (CUDA, torch.bfloat16, 16, 64, "multiple of 256 (it is 16)"),
        (CUDA, torch.bfloat16, 256, 68, "head size"),
        (CUDA, torch.float16, 512, 512, "head size"),
        (torch.device("cpu"), torch.bfloat16, 256, 64, "CUDA device (the executor runs on cpu)"),
    ],
)
def test_unavailable_names_what_the_kernel_needs(
    device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int, reason: str
) -> None:
    found = unavailable(device, dtype, block_size, head_dim)
    assert found is not None and reason in found


def _pool(blocks: int, block_size: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (blocks * block_size, kv_heads, dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_gathered_reference_equals_attention_over_each_requests_own_slots(heads: int, kv_heads: int) -> None:
    block_size, dim = 4, 8
    keys, values = _pool(16, block_size, kv_heads, dim, seed=1)
    lengths = [1, 4, 5, 9, 12]  # within, at and across block edges
    width = 3
    order = torch.randperm(16, generator=torch.Generator().manual_seed(2))
    tables = order[: len(lengths) * width].view(len(lengths), width).to(torch.int32)
    q = torch.randn(len(lengths), heads, dim, generator=torch.Generator().manual_seed(3))
    group = PagedGroup.of(torch.arange(len(lengths)), tables, torch.tensor(lengths))
    got = gathered_reference(q, keys, values, group, block_size, 0.3)
    for row, length in enumerate(lengths):
        slots = [int(tables[row, t // block_size]) * block_size + t % block_size for t in range(length)]
        k = keys[slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, d]
        v = values[slots].transpose(0, 1).unsqueeze(0)
        want = F.scaled_dot_product_attention(q[row][None, :, None], k, v, scale=0.3, enable_gqa=heads != kv_heads)
        torch.testing.assert_close(got[row], want[0, :, 0], rtol=1e-5, atol=1e-6)


def test_attend_paged_off_cuda_is_the_gathered_reference() -> None:
    keys, values = _pool(8, 4, 2, 8, seed=4)
    group = PagedGroup.of(torch.arange(2), torch.tensor([[3, 1], [0, 7]]), torch.tensor([6, 2]))
    q = torch.randn(2, 4, 8)
    got = attend_paged(q, keys, values, group, 4, 0.5)
    torch.testing.assert_close(got, gathered_reference(q, keys, values, group, 4, 0.5))


def test_self_test_passes_the_reference_and_catches_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert self_test(cpu, torch.float32, 16, 4, 2, 8) is None

    def ignores_lengths(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: PagedGroup, *rest: float
    ) -> torch.Tensor:
        tables = group.block_tables
        every_key = torch.full_like(group.lengths, tables.shape[1] * 16)  # reads each table's padding too
        return gathered_reference(q, keys, values, PagedGroup.of(group.rows, tables, every_key), 16, 8**-0.5)

    monkeypatch.setattr(paged_decode, "attend_paged", ignores_lengths)
    found = self_test(cpu, torch.float32, 16, 4, 2, 8)
    assert found is not None and "differs from the gathered reads" in found

    def raises(*args: object) -> torch.Tensor:
        raise RuntimeError("Paged KV cache block size must be divisible by 256")

    monkeypatch.setattr(paged_decode, "attend_paged", raises)
    found = self_test(cpu, torch.float32, 16, 4, 2, 8)
    assert found is not None and "divisible by 256" in found


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attention_reads_the_pool_in_place_as_the_gather_does(dtype: torch.dtype) -> None:
    device = torch.device("cuda")
    if unavailable(device, dtype, 256, 64) is not None:
        pytest.skip(str(unavailable(device, dtype, 256, 64)))
    assert self_test(device, dtype, 256, 8, 2, 64) is None
    keys, values = (t.to(device, dtype) for t in _pool(10, 256, 2, 64, seed=5))
    tables = torch.tensor([[4, 2, 9], [0, 7, 7], [1, 1, 1]], device=device)  # padding repeats
    group = PagedGroup.of(torch.arange(3, device=device), tables, torch.tensor([700, 257, 1], device=device))
    q = torch.randn(3, 8, 64, device=device, dtype=dtype)
    got = attend_paged(q, keys, values, group, 256, 0.125)
    want = gathered_reference(q, keys, values, group, 256, 0.125)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_key_offsets_are_the_rows_keys_packed() -> None:
    offsets = PagedGroup.of(torch.arange(3), torch.zeros(3, 1), torch.tensor([3, 1, 5])).key_offsets
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 3, 4, 9]

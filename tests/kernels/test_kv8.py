"""8-bit KV rows (int8, fp8 e4m3, fp8 e5m2 with a float16 scale per group of channels of a token and KV head): quantised within the format's
rounding, read in place by the paged and prefill attention kernels as PyTorch reads them dequantised, and written
by the C decode step byte for byte as the PyTorch path writes them."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)

from fleetllm.kernels import attention, decode_stack, kv8, prefill
from fleetllm.kernels.attention import chunk_rows, paged_attention, reference_attention

BLOCK = 16
EIGHT_BIT = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def caches(dtype: torch.dtype, kv_heads: int, dim: int, blocks: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(dim + kv_heads)
    k = torch.randn(blocks * BLOCK, kv_heads, dim, generator=g) * 3
    return kv8.quantize(k, dtype), kv8.quantize(torch.randn(blocks * BLOCK, kv_heads, dim, generator=g), dtype)


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_rows_keep_a_scale_per_group_and_round_within_the_format(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)  # magnitudes within the float16 scales' normal range (kv8.SHIFT)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-2, 3, 50).view(-1, 1, 1)
    x[:, :, 5] *= 30  # an outlier channel: it coarsens its own group's rounding, not the row's
    rows = kv8.quantize(x, dtype)
    assert rows.shape == (50, 3, 64 + kv8.SCALE_BYTES * 64 // kv8.GROUP) and rows.dtype == dtype
    amax = x.unflatten(-1, (-1, kv8.GROUP)).abs().amax(-1, keepdim=True).expand(-1, -1, -1, kv8.GROUP).flatten(-2)
    # int8: half a step of amax / 127 (that rounded to float16: 2^-11 more); fp8: half an ulp of the element (3 or
    # 2 mantissa bits), plus the subnormals'
    bound = amax / 254 if dtype == torch.int8 else x.abs() * {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}[dtype]
    floor = amax / kv8.QMAX[dtype] * (2**-9 if dtype == torch.float8_e4m3fn else 2**-16)
    assert ((kv8.dequantize(rows) - x).abs() <= bound * (1 + 2**-10) + floor * 1.001).all()


@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (6, 2, 24), (4, 4, 20)])
def test_the_paged_kernel_reads_8bit_rows_in_place(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> None:
    require_kernels(attention.LIBRARY)  # dim 64: the AVX-512 path (AVX2 without it); 24: AVX2; 20: scalar
    k, v = caches(dtype, kv_heads, dim)
    lens = torch.tensor([1, 17, 300, 600], dtype=torch.int32)
    tables = torch.stack([torch.randperm(40)[:38] for _ in range(4)]).int()
    q = torch.randn(4, heads, dim)
    for window in (None, 33):
        got = paged_attention(q, k, v, tables, lens, dim**-0.5, BLOCK, window)
        want = reference_attention(q, k, v, tables, lens, dim**-0.5, BLOCK, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e5m2])
def test_a_chunks_queries_over_8bit_rows_read_together_equal_each_read_alone(dtype: torch.dtype) -> None:
    require_kernels(attention.LIBRARY)  # a verify chunk's rows share each widened key (AVX-512), with each row's floats
    k, v = caches(dtype, 3, 64)
    n_q, n_ctx = 11, 517  # more rows than one pass over K takes; rows of 2 and of 3 partitions
    table, q = torch.randperm(40)[:33].int().view(1, -1), torch.randn(n_q, 9, 64)
    rows, lens = chunk_rows(n_q, n_ctx)
    together = paged_attention(q, k, v, table, lens, 0.125, BLOCK, table_of=rows)
    for r in range(n_q):
        assert torch.equal(together[r], paged_attention(q[r : r + 1], k, v, table, lens[r : r + 1], 0.125, BLOCK)[0]), r


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_the_prefill_kernel_reads_8bit_rows_in_place(dtype: torch.dtype) -> None:
    require_kernels(prefill.LIBRARY)
    k, v = caches(dtype, 3, 64)
    table, n_q, n_ctx = torch.randperm(40)[:30].int(), 70, 470
    q = torch.randn(n_q, 9, 64)
    rows, lens = chunk_rows(n_q, n_ctx)
    for window in (None, 100):
        got = prefill.prefill_attention(q, k, v, table, n_ctx, 0.125, BLOCK, window)
        want = reference_attention(q, k, v, table.view(1, -1), lens, 0.125, BLOCK, window, rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_the_c_decode_step_stores_the_bytes_pytorch_stores(dtype: torch.dtype) -> None:
    require_kernels(decode_stack.LIBRARY)
    x = torch.randn(40, 3, 64) * torch.logspace(-6, 3, 40).view(-1, 1, 1)  # subnormal fp8 values included
    x[3], x[5, 1] = 0.0, 0.0  # all-zero rows
    slots = torch.randperm(50)[:40]
    x[7, 2, 20:] = 0.0  # a row's all-zero groups
    width = kv8.row_width(64, dtype)
    torch_rows, c_rows = torch.zeros(50, 3, width, dtype=dtype), torch.zeros(50, 3, width, dtype=dtype)
    kv8.copy_rows(torch_rows, slots, kv8.quantize(x, dtype))  # PyTorch's arithmetic (kv8.store takes the C one)
    decode_stack.store_rows(c_rows, slots, x)
    assert torch.equal(torch_rows.view(torch.uint8), c_rows.view(torch.uint8))

"""The prefill-attention kernel computes what gathering the context and a causal softmax in PyTorch computes.

Chunks from one query to several tiles, fresh prompts and chunks over cached context, blocks in random order,
GQA groups of 1-8 and head_dims 16-256, sliding windows, fp32/fp16/bf16 caches, strided queries and outputs;
and the model's prefill through the kernel equals the one through SDPA.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)

from fleetllm.kernels import attention
from fleetllm.kernels.attention import chunk_rows, reference_attention
from fleetllm.kernels.prefill import LIBRARY, prefill_attention, prefill_ready

BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    require_kernels(LIBRARY)
    assert prefill_ready(torch.zeros(1, 1, 64), torch.zeros(1, 1, 64))


def random_chunk(heads: int, kv_heads: int, dim: int, n_q: int, n_ctx: int, dtype: torch.dtype = torch.float32):
    torch.manual_seed(n_q * 1000 + n_ctx + heads + dim)
    blocks = -(-n_ctx // BLOCK)
    k = torch.randn((blocks + 3) * BLOCK, kv_heads, dim).to(dtype)
    v = torch.randn((blocks + 3) * BLOCK, kv_heads, dim).to(dtype)
    table = torch.randperm(blocks + 3)[:blocks].int()
    return torch.randn(n_q, heads, dim) * 3, k, v, table


def reference(q, k, v, table, n_ctx, window=None):
    rows, lens = chunk_rows(q.shape[0], n_ctx)
    return reference_attention(q, k, v, table.view(1, -1), lens, q.shape[2] ** -0.5, BLOCK, window, table_of=rows)


@pytest.mark.parametrize(("n_q", "n_ctx"), [(1, 1), (5, 5), (16, 16), (17, 100), (130, 130), (70, 301), (1, 300)])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 80), (8, 1, 128), (6, 2, 256), (5, 5, 16)])
def test_chunk_equals_gathered_causal_attention(n_q: int, n_ctx: int, heads: int, kv_heads: int, dim: int) -> None:
    q, k, v, table = random_chunk(heads, kv_heads, dim, n_q, n_ctx)
    got = prefill_attention(q, k, v, table, n_ctx, dim**-0.5, BLOCK)
    torch.testing.assert_close(got, reference(q, k, v, table, n_ctx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_q", [2, 4, 6, 12])  # 8, 16, 24, 48 of a tile's rows: one, two, two, three vectors
def test_short_chunk_over_a_long_context_equals_gathered_attention(n_q: int) -> None:
    q, k, v, table = random_chunk(4, 1, 256, n_q, 700)  # Gemma 3's shape: a speculative verify's chunk
    got = prefill_attention(q, k, v, table, 700, 0.0625, BLOCK)
    torch.testing.assert_close(got, reference(q, k, v, table, 700), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 64, 100, 500])
@pytest.mark.parametrize(("n_q", "n_ctx"), [(40, 40), (90, 300)])
def test_sliding_window_sees_only_its_last_positions(window: int, n_q: int, n_ctx: int) -> None:
    q, k, v, table = random_chunk(9, 3, 64, n_q, n_ctx)
    got = prefill_attention(q, k, v, table, n_ctx, 0.125, BLOCK, window)
    torch.testing.assert_close(got, reference(q, k, v, table, n_ctx, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches_are_read_as_stored(dtype: torch.dtype) -> None:
    q, k, v, table = random_chunk(9, 3, 64, 50, 200, dtype)
    got = prefill_attention(q, k, v, table, 200, 0.125, BLOCK)
    torch.testing.assert_close(got, reference(q, k, v, table, 200), rtol=1e-5, atol=1e-5)


def test_strided_queries_write_a_strided_output() -> None:
    q, k, v, table = random_chunk(9, 3, 64, 20, 60)
    fused = torch.randn(20, 15 * 64)  # q columns of a fused qkv projection
    fused[:, : 9 * 64] = q.view(20, -1)
    out = torch.zeros(20, 10 * 64)[:, : 9 * 64].view(20, 9, 64)
    prefill_attention(fused[:, : 9 * 64].view(20, 9, 64), k, v, table, 60, 0.125, BLOCK, out=out)
    torch.testing.assert_close(out, reference(q, k, v, table, 60), rtol=1e-5, atol=1e-5)


def test_a_table_too_short_for_the_context_is_refused() -> None:
    q, k, v, table = random_chunk(9, 3, 64, 10, 40)
    with pytest.raises(ValueError, match="layout"):
        prefill_attention(q, k, v, table[:2], 40, 0.125, BLOCK)


def test_shapes_the_kernel_does_not_take_stay_on_sdpa() -> None:
    assert not prefill_ready(torch.zeros(1, 4, 24), torch.zeros(1, 4, 24))  # head_dim not a multiple of 16
    attention.set_kernel_enabled(False)
    try:
        assert not prefill_ready(torch.zeros(1, 9, 64), torch.zeros(1, 3, 64))
    finally:
        attention.set_kernel_enabled(True)


def test_model_prefill_through_the_kernel_equals_sdpa(loaded_model) -> None:
    """SmolLM2's prefill of a fresh chunk, then a chunk over its cached context: the kernel or SDPA, the same."""
    from fleetllm.models.llama import AttentionMetadata, PrefillChunk

    model, cfg = loaded_model.model, loaded_model.config
    blocks, n = 8, 120
    table = torch.randperm(blocks).int()
    slots = (table.long().repeat_interleave(BLOCK) * BLOCK + torch.arange(BLOCK).repeat(blocks))[:n]
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))

    def prefill(kernel: bool) -> torch.Tensor:
        shape = (blocks * BLOCK, cfg.num_kv_heads, cfg.head_dim)
        cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        attention.set_kernel_enabled(kernel)
        try:
            hidden = []
            for start, end in [(0, 70), (70, n)]:
                chunk = PrefillChunk(0, end - start, slots[:end], fresh=start == 0, block_table=table, context_len=end)
                meta = AttentionMetadata(slot_mapping=slots[start:end], prefills=[chunk], block_size=BLOCK)
                hidden.append(model(tokens[start:end], torch.arange(start, end), meta, cache))
            return torch.cat(hidden)
        finally:
            attention.set_kernel_enabled(True)

    torch.testing.assert_close(prefill(True), prefill(False), rtol=1e-4, atol=1e-4)

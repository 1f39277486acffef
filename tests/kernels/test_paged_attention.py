"""The C paged-attention kernel computes what gathering K/V and a softmax in PyTorch computes.

Random caches and block tables (blocks in random order, shared between rows as a prefix cache shares them),
GQA groups, lengths from one position to several blocks, sliding windows, fp32/fp16/bf16 caches, the
vector path (head_dim a multiple of 8) and the scalar one, decode rows and causal chunks over cached context,
contexts long enough to be split into partitions (over ``PART_KEYS`` = 256 keys) and combined, and heads wider
than one 64-dim pass (16- and 32-bit caches score key by key).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)

from fleetllm.kernels import attention, build
from fleetllm.kernels.attention import chunk_rows, kernel_ready, paged_attention, reference_attention

BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    require_kernels(attention.LIBRARY)


def random_case(heads: int, kv_heads: int, dim: int, lens: list[int], dtype: torch.dtype = torch.float32):
    torch.manual_seed(sum(lens) + heads + dim)
    num_blocks = 64
    k = torch.randn(num_blocks * BLOCK, kv_heads, dim).to(dtype)
    v = torch.randn(num_blocks * BLOCK, kv_heads, dim).to(dtype)
    max_blocks = -(-max(lens) // BLOCK)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens]).int()
    tables[1:, 0] = tables[0, 0]  # a shared first block, as a prefix-cache hit leaves it
    q = torch.randn(len(lens), heads, dim)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 24), (6, 2, 20)])
@pytest.mark.parametrize("window", [None, 1, 7, 40])
def test_decode_equals_gathered_attention(heads: int, kv_heads: int, dim: int, window: int | None) -> None:
    q, k, v, tables, lens = random_case(heads, kv_heads, dim, [1, 15, 16, 17, 100, 333])
    got = paged_attention(q, k, v, tables, lens, dim**-0.5, BLOCK, window)
    want = reference_attention(q, k, v, tables, lens, dim**-0.5, BLOCK, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def threads_set(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dim", [64, 24])  # the vector path and the scalar one
@pytest.mark.parametrize("threads", [1, 2])
def test_long_contexts_split_into_partitions_equal_gathered_attention(dim: int, threads: int) -> None:
    q, k, v, tables, lens = random_case(4, 1, dim, [256, 257, 700, 1024])  # one KV head: Gemma 3's shape
    with threads_set(threads):
        got = paged_attention(q, k, v, tables, lens, dim**-0.5, BLOCK)
    torch.testing.assert_close(got, reference_attention(q, k, v, tables, lens, dim**-0.5, BLOCK), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [256, 80])  # Gemma 3's four 64-dim passes per key; one pass and a partial one
def test_wide_heads_scored_key_by_key_equal_gathered_attention(dim: int, dtype: torch.dtype) -> None:
    q, k, v, tables, lens = random_case(4, 1, dim, [3, 300, 1000], dtype)  # rows prefetched ahead, past block ends
    got = paged_attention(q, k, v, tables, lens, dim**-0.5, BLOCK, 700)
    want = reference_attention(q, k, v, tables, lens, dim**-0.5, BLOCK, 700)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_change_with_its_batch_or_the_threads() -> None:
    q, k, v, tables, lens = random_case(9, 3, 64, [900, 40, 600])  # partitions depend on the row's length only
    with threads_set(1):
        alone = paged_attention(q[:1], k, v, tables[:1], lens[:1], 0.125, BLOCK)
    with threads_set(2):
        batched = paged_attention(q, k, v, tables, lens, 0.125, BLOCK)
    assert torch.equal(batched[:1], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_chunks_queries_read_together_equal_each_read_alone(dtype: torch.dtype, threads: int) -> None:
    n_q, n_ctx = 12, 517  # more rows than one pass over K takes; rows of 2 and of 3 partitions
    _, k, v, tables, _ = random_case(9, 3, 64, [n_ctx], dtype)
    q = torch.randn(n_q, 9, 64)
    rows, lens = chunk_rows(n_q, n_ctx)
    with threads_set(threads):
        together = paged_attention(q, k, v, tables, lens, 0.125, BLOCK, table_of=rows)
    for r in range(n_q):
        alone = paged_attention(q[r : r + 1], k, v, tables, lens[r : r + 1], 0.125, BLOCK)
        assert torch.equal(together[r : r + 1], alone), r


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches_are_read_as_stored(dtype: torch.dtype) -> None:
    q, k, v, tables, lens = random_case(9, 3, 64, [5, 70, 200], dtype)
    got = paged_attention(q, k, v, tables, lens, 0.125, BLOCK)
    torch.testing.assert_close(got, reference_attention(q, k, v, tables, lens, 0.125, BLOCK), rtol=1e-5, atol=1e-5)


def test_rows_of_a_strided_query_write_a_strided_output() -> None:
    q, k, v, tables, lens = random_case(9, 3, 64, [3, 50, 90])
    fused = torch.randn(3, 15 * 64)  # q columns of a fused qkv projection: rows 15*64 apart
    fused[:, : 9 * 64] = q.view(3, -1)
    out = torch.zeros(3, 10 * 64)[:, : 9 * 64].view(3, 9, 64)
    paged_attention(fused[:, : 9 * 64].view(3, 9, 64), k, v, tables, lens, 0.125, BLOCK, out=out)
    torch.testing.assert_close(out, reference_attention(q, k, v, tables, lens, 0.125, BLOCK), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_chunk_over_cached_context_is_causal(window: int | None) -> None:
    n_q, n_ctx = 9, 75
    q, k, v, tables, _ = random_case(9, 3, 64, [n_ctx])
    q = torch.randn(n_q, 9, 64)
    rows, lens = chunk_rows(n_q, n_ctx)
    got = paged_attention(q, k, v, tables, lens, 0.125, BLOCK, window, table_of=rows)
    keys = tables[0].long().repeat_interleave(BLOCK) * BLOCK + torch.arange(BLOCK).repeat(tables.shape[1])
    kt = k[keys[:n_ctx]].transpose(0, 1).unsqueeze(0)
    vt = v[keys[:n_ctx]].transpose(0, 1).unsqueeze(0)
    q_pos, kv_pos = torch.arange(n_ctx - n_q, n_ctx).unsqueeze(1), torch.arange(n_ctx).unsqueeze(0)
    mask = (kv_pos <= q_pos) & (kv_pos > q_pos - (window or n_ctx))
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kt, vt, attn_mask=mask,
                                                            scale=0.125, enable_gqa=True)
    torch.testing.assert_close(got, want.squeeze(0).transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_disabled_kernel_serves_the_eager_result() -> None:
    q, k, v, tables, lens = random_case(9, 3, 64, [10, 40])
    attention.set_kernel_enabled(False)
    try:
        assert not kernel_ready(q, k)
        got = paged_attention(q, k, v, tables, lens, 0.125, BLOCK)
    finally:
        attention.set_kernel_enabled(True)
    torch.testing.assert_close(got, reference_attention(q, k, v, tables, lens, 0.125, BLOCK))


def test_layout_the_kernel_cannot_read_is_refused() -> None:
    q, k, v, tables, lens = random_case(9, 3, 64, [10, 40])
    with pytest.raises(ValueError, match="layout"):
        paged_attention(q, k, v, tables.long(), lens, 0.125, BLOCK)


def tiny_kernel(folder: Path) -> Path:
    """A one-function C source: the build's caching is what is checked, not a kernel's (seconds to compile)."""
    folder.mkdir()
    (folder / "tiny.c").write_text("int tiny(int x) { return 2 * x; }\n")
    return folder / "tiny.c"


def test_built_kernel_is_a_cache_hit_next_time(tmp_path: Path) -> None:
    source, out = tiny_kernel(tmp_path / "src"), tmp_path / "cache"  # not the shared cache: another process may
    path = build.build(source, out, "portable")  # be building the same key there right now
    stamp = path.stat().st_mtime_ns
    assert build.build(source, out, "portable") == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in out.iterdir() if not p.name.endswith(".lock")] == [path.name]  # no temporary file left


def test_processes_needing_one_kernel_at_once_compile_it_once(monkeypatch, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    cc = tmp_path / "cc"  # the system compiler, counting its compiles (not its --version)
    cc.write_text(f'#!/bin/sh\ncase "$*" in *" -o "*) echo x >> {calls};; esac\nexec gcc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setattr(build, "compiler", lambda: str(cc))
    source, out = tiny_kernel(tmp_path / "src"), tmp_path / "cache"
    with ThreadPoolExecutor(3) as pool:  # flock excludes open files, so threads stand in for processes
        paths = list(pool.map(lambda _: build.build(source, out, "portable"), range(3)))
    assert len(set(paths)) == 1 and paths[0].exists()
    assert calls.read_text().count("x") == 1


def test_no_compiler_means_eager_said_once(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setattr(build, "compiler", lambda: None)
    for path in [attention.LIBRARY.source, *attention.LIBRARY.source.parent.glob("*.h")]:
        shutil.copy(path, tmp_path)  # a checkout's source, with no prebuilt object beside it
    lib = build.KernelLibrary(tmp_path / "paged_attention.c", lambda _: None)
    with caplog.at_level(logging.INFO, logger="fleetllm.kernels.build"):
        assert lib.get(wait=True) is None
        assert lib.get(wait=True) is None
    assert len(caplog.records) == 1 and "no C compiler" in caplog.text

"""8-bit KV cache rows (``--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2``): layout, writing and reading.

An 8-bit cache keeps, for every (token, KV head), its ``head_dim`` values in 8 bits followed by one float16 scale
per ``GROUP`` (8) channels: a layer's cache is ``[slots, kv_heads, row_width(head_dim)]`` of ``torch.int8``,
``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (80 bytes for head_dim 64). A scale is ``max |x| / qmax`` of
its group (qmax: 127, 448, 57344) rounded to float16, so each group's largest value is about the format's
largest; it is stored times ``2 ** SHIFT[dtype]`` (exact: a power of two), which puts the float16 near an eighth of
the group's largest |value|, normal from about 5e-4 to 4.6e5 (an fp8 scale itself would be a float16
subnormal below max |x| of 0.03 or 3.5). The value of element ``i`` is ``row[i] * scale[i // GROUP]``.

Why per token and head, next to the values: a token's K/V is written once, when it is computed (a decode
step writes one row, no block is ever requantised, as a per-block scale would need when a later token is
larger); an outlier token costs precision to no other; and every copy of a block (P/D frames, the KV tiers,
the prefix cache's blocks) carries its scales with it, because they are the same bytes. Why per group of
channels rather than per row: keys have outlier channels, and a row-wide scale set by one of them rounds the
row's other channels coarsely (the KL divergence from fp32 KV's next-token distribution on SmolLM2-135M: 1.05e-3
with a scale per row, 4.0e-4 per 16 channels, 2.9e-4 with a float16 per 8; docs/kv-cache-dtype.md). Sixteen
bytes of scales per 64 values: 25% on top of the 8-bit payload (80 bytes a row against fp32's 256).

The C kernels (paged_attention.c, prefill_attention.c, decode_stack.c; the layout's constants in kv8.h) read
and write this layout in place; :func:`store` and :func:`read` are the PyTorch paths' (which may dequantise the
rows they read), and :func:`convert` / :func:`copy_rows` move rows between pools of different layouts.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2  # a float16; the C kernels' KV8_SCALE_BYTES
GROUP = 8  # channels per scale; the C kernels' KV8_GROUP (an AVX2 vector: one group, an AVX-512 one: two)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SHIFT = {torch.int8: 4, torch.float8_e4m3fn: 6, torch.float8_e5m2: 13}  # stored = scale * 2**SHIFT; KV8_SHIFT
F16_MAX = 65504.0


def quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds 8-bit rows with their scales."""
    return dtype in QMAX


def groups(head_dim: int) -> int:
    """Scales of one 8-bit row: one per ``GROUP`` channels (the last group may be shorter)."""
    return -(-head_dim // GROUP)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of a cache of ``dtype``: ``head_dim``, plus the scales' bytes when 8-bit."""
    return head_dim + SCALE_BYTES * groups(head_dim) if quantized(dtype) else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head_dim of a cache (or a block of one) whose rows are its last dimension."""
    width = cache.shape[-1]
    if not quantized(cache.dtype):
        return width
    # width = d + SCALE_BYTES ceil(d / GROUP) lies in [d (1 + SCALE_BYTES / GROUP), that + SCALE_BYTES]; it grows
    # with d, so one d has it
    low = (width - SCALE_BYTES) * GROUP // (GROUP + SCALE_BYTES)
    return next(d for d in range(max(low, 1), width) if row_width(d, cache.dtype) == width)


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` as ``[..., groups, GROUP]``, the last group padded with zeros."""
    d = x.shape[-1]
    pad = groups(d) * GROUP - d
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(*x.shape[:-1], -1, GROUP)


def scales(amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's scale for its largest |value| ``amax``: as stored (float16, times ``2 ** SHIFT``) and as
    applied (float32). A group whose float16 is 0 (all zeros, or too small to matter) stores 1."""
    unit = 2.0 ** SHIFT[dtype]
    stored = (amax / QMAX[dtype] * unit).clamp_(max=F16_MAX).half()
    stored = torch.where(stored > 0, stored, torch.ones_like(stored))
    return stored, stored.float() / unit


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x [..., D]`` as ``[..., row_width(D)]`` of ``dtype``: 8-bit values, then one float16 scale per group.

    Division by the float16 scale (not a multiplication by its reciprocal) and round-half-even, as
    decode_stack.c rounds, so both writers store the same bytes for the same values."""
    x, d = x.float(), x.shape[-1]
    qmax = QMAX[dtype]
    g = _grouped(x)
    stored, scale = scales(g.abs().amax(dim=-1, keepdim=True), dtype)
    y = (g / scale).clamp_(-qmax, qmax).flatten(-2)[..., :d]
    q = y.round_().to(torch.int8) if dtype == torch.int8 else y.to(dtype)
    out = torch.empty(*x.shape[:-1], row_width(d, dtype), dtype=torch.uint8, device=x.device)
    out[..., :d] = q.view(torch.uint8)
    out[..., d:] = stored.squeeze(-1).contiguous().view(torch.uint8)
    return out.view(dtype)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """8-bit rows ``[..., row_width(D)]`` back to ``[..., D]`` values in ``dtype``."""
    d = head_dim_of(rows)
    raw = rows.contiguous().view(torch.uint8)
    scale = raw[..., d:].contiguous().view(torch.float16).float().unsqueeze(-1) / 2.0 ** SHIFT[rows.dtype]
    return (_grouped(rows[..., :d].float()) * scale).flatten(-2)[..., :d].to(dtype)


def read(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``index`` of ``cache`` as ``[len(index), kv_heads, head_dim]`` values in ``dtype`` (the eager reads)."""
    rows = cache.index_select(0, index)
    return dequantize(rows, dtype) if quantized(cache.dtype) else rows.to(dtype)


def convert(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of one cache layout in another's (a frame or block from a pool of another dtype): 8-bit rows are
    dequantised, and quantised for an 8-bit destination; the same layout is returned as it is."""
    if rows.dtype == dtype:
        return rows
    values = dequantize(rows) if quantized(rows.dtype) else rows
    return quantize(values, dtype) if quantized(dtype) else values.to(dtype)


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write the new K or V ``x [T, kv_heads, head_dim]`` into ``cache`` at ``slots`` (quantised when 8-bit).

    8-bit rows on the CPU go through the C decode step's writer where it is loaded (the same bytes, one call
    instead of a dozen ops: 4 against 45 microseconds for a decode token's row, 30 layers x K and V a step)."""
    if quantized(cache.dtype) and _c_writer(cache):
        from fleetllm.kernels import decode_stack

        decode_stack.store_rows(cache, slots, x)
        return
    copy_rows(cache, slots, quantize(x, cache.dtype) if quantized(cache.dtype) else x.to(cache.dtype))


def _c_writer(cache: torch.Tensor) -> bool:
    """Whether decode_stack.c's writer takes rows into ``cache`` now (never waits for its build)."""
    if cache.device.type != "cpu" or not cache.is_contiguous():
        return False
    from fleetllm.kernels import decode_stack

    lib = decode_stack.LIBRARY.get()
    return lib is not None and lib.decode_stack_isa() == 2


def copy_rows(cache: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache.index_copy_(0, index, rows)`` with ``rows`` converted to the cache's layout; 8-bit rows copied as
    bytes (PyTorch has no fp8 ``index_copy_`` on the CPU)."""
    rows = convert(rows, cache.dtype).to(cache.device)
    if quantized(cache.dtype):
        cache.view(torch.uint8).index_copy_(0, index, rows.contiguous().view(torch.uint8))
    else:
        cache.index_copy_(0, index, rows)

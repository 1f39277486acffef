"""Paged attention read in place (fleetllm.kernels) against the eager gather, in one process, one run.

Two measurements, each eager and kernel back to back so the ratios share the machine's load:

* attention alone, one layer of SmolLM2-135M's shape (9 heads, 3 KV heads, head_dim 64): the eager path's
  gather + matmul + softmax (``Attention._decode``) against the C kernel, at batch 1/8/32 and contexts 256/1024;
* a chunk of 1-16 queries over 1,024 cached positions (speculative verification, chunked prefill): the kernel
  against gather + SDPA, which sets ``KERNEL_MAX_CHUNK`` in fleetllm/kernels/decode_stack.py;
* a whole decode step (``ModelRunner.execute``: 30 layers, LM head) at batch 1/8/32, every sequence at the same
  context length, for exact fp32 and for ``--quantization int4``.

    python benchmarks/paged_attention.py [--context 512] [--steps 24] [--batches 1 8 32] [--quant none int4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetllm.engine.model_runner import ModelRunner  # noqa: E402
from fleetllm.kernels import attention  # noqa: E402
from fleetllm.models.llama import Attention  # noqa: E402
from fleetllm.models.loader import load_model  # noqa: E402
from fleetllm.models.quant import quantize_model  # noqa: E402

BLOCK = 16
BATCHES = (1, 8, 32)


@dataclass
class FakeSeq:
    """What the runner reads of a sequence: its computed tokens, its blocks and its last token."""

    num_computed_tokens: int
    block_table: list[int]
    tokens: list[int] = field(default_factory=list)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        return [7] * (end - start)


@dataclass
class FakeScheduled:
    seq: FakeSeq
    num_new_tokens: int = 1
    draft_token_ids: list[int] = field(default_factory=list)

    def token_ids(self) -> list[int]:
        return self.seq.token_ids_slice(0, 1)


def timed(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs after two warm-ups."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def both(fn, repeats: int) -> tuple[float, float]:
    """(eager ms, kernel ms) of ``fn``, interleaved in rounds so that load changes hit both alike."""
    eager, kernel = [], []
    for _ in range(3):
        for enabled, out in ((False, eager), (True, kernel)):
            attention.set_kernel_enabled(enabled)
            out.append(timed(fn, max(1, repeats // 3)))
    attention.set_kernel_enabled(True)
    return statistics.median(eager), statistics.median(kernel)


def attention_only(context: int, repeats: int, batches: list[int]) -> None:
    print(f"\n## attention of one layer (9 heads, 3 KV heads, d 64), ms per call; context {context}")
    print("| batch | context | eager gather | kernel | speed-up |\n|---|---|---|---|---|")
    from fleetllm.models.config import ModelConfig

    cfg = ModelConfig(architecture="llama", hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9, num_kv_heads=3,
                      head_dim=64, vocab_size=100, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=4096)
    attn = Attention(cfg)
    for ctx in (context // 2, context * 2):
        for b in batches:
            runner_meta = decode_meta(b, ctx, b * (-(-ctx // BLOCK)))
            k = torch.randn(b * (-(-ctx // BLOCK)) * BLOCK, 3, 64)
            v = torch.randn_like(k)
            q = torch.randn(b, 9, 64)
            out = torch.empty_like(q)

            def step(q=q, k=k, v=v, out=out, meta=runner_meta) -> None:
                if attention.kernel_ready(q, k):
                    attn._decode_paged(q, meta, k, v, out)
                else:
                    attn._decode(q, meta, k, v)

            e, kk = both(step, repeats)
            print(f"| {b} | {ctx} | {e:.3f} | {kk:.3f} | {e / kk:.2f}× |")


def chunks(repeats: int) -> None:
    import torch.nn.functional as F

    n_ctx = 1024
    k = torch.randn(n_ctx, 3, 64)
    v = torch.randn_like(k)
    table = torch.randperm(n_ctx // BLOCK).int()
    slots = (table.long().unsqueeze(1) * BLOCK + torch.arange(BLOCK)).flatten()
    print(f"\n## a chunk over {n_ctx} cached positions, ms per call (kernel always; eager = gather + SDPA)")
    print("| queries | gather + SDPA | kernel | speed-up |\n|---|---|---|---|")
    for n_q in (1, 2, 4, 8, 16):
        q = torch.randn(n_q, 9, 64)
        rows, lens = attention.chunk_rows(n_q, n_ctx)
        mask = torch.arange(n_ctx).unsqueeze(0) <= torch.arange(n_ctx - n_q, n_ctx).unsqueeze(1)

        def sdpa(q=q, mask=mask) -> torch.Tensor:
            kt, vt = k[slots].transpose(0, 1).unsqueeze(0), v[slots].transpose(0, 1).unsqueeze(0)
            return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kt, vt, attn_mask=mask, scale=0.125,
                                                  enable_gqa=True)

        e = timed(sdpa, repeats)
        kk = timed(lambda q=q, rows=rows, lens=lens: attention.paged_attention(
            q, k, v, table.view(1, -1), lens, 0.125, BLOCK, table_of=rows), repeats)
        print(f"| {n_q} | {e:.3f} | {kk:.3f} | {e / kk:.2f}× |")


def decode_meta(batch: int, ctx: int, num_blocks: int):
    """The metadata the runner builds for ``batch`` decode queries at context ``ctx`` (blocks in a shuffled order)."""
    from fleetllm.models.llama import AttentionMetadata

    per = -(-ctx // BLOCK)
    blocks = torch.randperm(num_blocks)[: batch * per].view(batch, per).tolist()
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device = BLOCK, "cpu"
    tables = runner._decode_tables(blocks, [ctx] * batch)
    return AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.long), decode_idx=torch.arange(batch),
                             decode_tables=tables, decode_lens=torch.full((batch,), ctx, dtype=torch.int32),
                             block_size=BLOCK)


def whole_steps(context: int, repeats: int, quant: str, batches: list[int]) -> None:
    loaded = load_model("smollm2-135m")
    quantize_model(loaded.model, quant)
    per = -(-(context + 1) // BLOCK)
    runner = ModelRunner(loaded.model, num_blocks=max(batches) * per + 1, block_size=BLOCK)
    print(f"\n## decode step of SmolLM2-135M ({quant}), ms per step (ModelRunner.execute); context {context}")
    print("| batch | eager gather | kernel | speed-up |\n|---|---|---|---|")
    for b in batches:
        seqs = [FakeScheduled(FakeSeq(context, list(range(i * per, (i + 1) * per)))) for i in range(b)]
        e, k = both(lambda seqs=seqs: runner.execute(seqs, list(range(len(seqs)))), repeats)
        print(f"| {b} | {e:.1f} | {k:.1f} | {e / k:.2f}× |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512, help="tokens of context each sequence attends to")
    ap.add_argument("--steps", type=int, default=24, help="timed repeats of each measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--quant", nargs="+", default=["none", "int4"], help="whole-step runs: none and/or int4")
    ap.add_argument("--no-attention-only", action="store_true", help="whole steps only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not attention.kernel_ready(torch.zeros(1), torch.zeros(1), wait=True):
        sys.exit(f"C kernel unavailable: {attention.LIBRARY.error}")
    print(f"threads {args.threads}; kernel isa {'avx2' if attention.LIBRARY.lib.paged_attention_isa() else 'scalar'}; "
          f"load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if not args.no_attention_only:
        attention_only(args.context, args.steps * 4, args.batches)
        chunks(args.steps * 2)
    for quant in args.quant:
        whole_steps(args.context, args.steps, quant, args.batches)
    print(f"\nload at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, returns logits.

A verifying sequence (1 + K tokens: its last sampled token and K draft tokens) is just a short chunk
over cached context; the caller asks for logits at each of its rows. A KV connector's worker side
(:mod:`fleetllm.engine.kv_connector`) is driven here: loads started before the forward (and where the step
computes), each layer waited for and saved, saves waited for after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch

from fleetllm.engine.config import FAST_PATH_KV_DTYPE
from fleetllm.engine.kv_connector.base import KVConnectorMetadata, KVConnectorWorker, StepKV
from fleetllm.engine.kv_memory import SharedKVFile, kv_memory
from fleetllm.engine.scheduler import Scheduled
from fleetllm.engine.step_pause import StepPause
from fleetllm.engine.step_profile import StepProfile, phase
from fleetllm.kernels import kv8
from fleetllm.lora.batch import LoraBatch
from fleetllm.lora.tables import LoraTables
from fleetllm.models.llama import AttentionMetadata, LlamaModel, PrefillChunk

KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8,
             "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_dtype_of(name: str, model: LlamaModel, quantization: str = "none") -> torch.dtype:
    """The KV cache's dtype for a ``--kv-cache-dtype`` name: ``auto`` is :data:`FAST_PATH_KV_DTYPE` for an fp32
    model with quantised weights, else the model's own dtype."""
    if name != "auto":
        return KV_DTYPES[name]
    own = next(model.parameters()).dtype
    return KV_DTYPES[FAST_PATH_KV_DTYPE] if own == torch.float32 and quantization != "none" else own


class ModelRunner:
    """Owns the KV cache tensors (one flat ``[num_blocks * block_size, kv_heads, head_dim]`` K and V per layer).

    The cache may be narrower than the model (``kv_dtype`` bf16/fp16 under fp32 weights): attention casts
    what it stores and upcasts what it reads, so only the pool's bytes change. An 8-bit ``kv_dtype`` (int8,
    fp8) has rows of ``kv8.row_width(head_dim)``: the values, then their scales (:mod:`fleetllm.kernels.kv8`).
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: str = "cpu",
                 kv_dtype: torch.dtype | None = None, profile: StepProfile | None = None,
                 shared: Path | None = None) -> None:
        """``shared``: a directory to keep the KV pool in as a shared-memory file (see :mod:`.kv_memory`)."""
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = device
        self.profile = profile
        self.kv_dtype = kv_dtype or next(model.parameters()).dtype
        shape = (num_blocks * block_size, cfg.num_kv_heads, kv8.row_width(cfg.head_dim, self.kv_dtype))
        pool, pool_file = kv_memory(2 * cfg.num_layers * shape[0] * shape[1] * shape[2], self.kv_dtype, device, shared)
        self.pool_file: SharedKVFile | None = pool_file  # None: private memory
        per = pool.view(2 * cfg.num_layers, *shape)
        self.kv_cache = [(per[2 * i], per[2 * i + 1]) for i in range(cfg.num_layers)]
        self.connector: KVConnectorWorker | None = None  # the KV connector's worker side, if attached
        self.lora_tables: LoraTables | None = None  # the resident adapters' weights (--enable-lora)

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int, kv_dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V, all layers, for one block of ``block_size`` tokens stored in ``kv_dtype``."""
        cfg = model.cfg
        dtype = kv_dtype or next(model.parameters()).dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * kv8.row_width(cfg.head_dim, dtype) * itemsize

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        bt = torch.tensor(block_table[start // bs : (end - 1) // bs + 1], dtype=torch.long)
        slots = (bt.unsqueeze(1) * bs + torch.arange(bs)).flatten()
        off = start - (start // bs) * bs
        return slots[off : off + end - start]

    @torch.inference_mode()
    def execute(
        self, batch: list[Scheduled], logit_rows: list[int], aux_layers: tuple[int, ...] | None = None,
        meta: KVConnectorMetadata | None = None, pause: StepPause | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one step; return logits ``[len(logit_rows), vocab]`` for the given rows of the flat batch,
        and with ``aux_layers`` the features of those decoder layers for every row (else None). ``meta``: the
        KV connector's part of the step; ``pause``: what may pause it between layers (:mod:`..step_pause`).

        The LM head runs over those rows only (a decode step: one row per sequence, not the whole batch)."""
        conn = self.connector if meta is not None else None
        with phase(self.profile, "prepare"):
            placed = conn.start_load_kv(meta, self.kv_cache) if conn is not None else None
            ids, positions, meta_attn = self._inputs(batch, placed)
            meta_attn.pause = pause
            rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            lora = self._lora(batch)
        kv = placed.kv_cache if placed else self.kv_cache
        with phase(self.profile, "forward"), self._hooked(conn, meta, meta_attn, kv):
            out = self.model(ids, positions, meta_attn, kv, aux_layers, lora) if lora else self.model(
                ids, positions, meta_attn, kv, aux_layers)
            hidden, aux = out if aux_layers is not None else (out, None)
        with phase(self.profile, "logits"):
            return self.model.compute_logits(hidden[rows]), aux

    def _lora(self, batch: list[Scheduled]) -> LoraBatch | None:
        """Each row's adapter slot (its sequence's), or None when no row of the step has an adapter."""
        if self.lora_tables is None or all(s.seq.lora_slot < 0 for s in batch):
            return None
        slots = [s.seq.lora_slot for s in batch for _ in range(s.num_new_tokens)]
        return LoraBatch.of(self.lora_tables, slots, self.device)

    def _inputs(self, batch: list[Scheduled],
                placed: StepKV | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and attention metadata of the flat batch (``placed``: its one sequence's blocks
        are those of the pool the connector placed the step in)."""
        ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        t = 0
        for s in batch:
            seq, n = s.seq, s.num_new_tokens
            c, blocks = seq.num_computed_tokens, placed.block_table if placed else seq.block_table
            ids.extend(s.token_ids())
            positions.extend(range(c, c + n))
            if n == 1:
                decode_idx.append(t)
                decode_tables.append(blocks)
                decode_lens.append(c + 1)
                slot_parts.append(self._slots(blocks, c, c + 1))
            else:
                ctx = self._slots(blocks, 0, c + n)
                slot_parts.append(ctx[c:])
                table = torch.tensor(blocks[: -(-(c + n) // self.block_size)], dtype=torch.int32)
                prefills.append(PrefillChunk(t, t + n, ctx, fresh=(c == 0), block_table=table, context_len=c + n))
            t += n

        meta = AttentionMetadata(slot_mapping=torch.cat(slot_parts).to(self.device), prefills=prefills,
                                 block_size=self.block_size, mask_dtype=next(self.model.parameters()).dtype)
        if decode_idx:
            meta.decode_idx = torch.tensor(decode_idx, device=self.device)
            meta.decode_tables = self._decode_tables(decode_tables, decode_lens)
            meta.decode_lens = torch.tensor(decode_lens, dtype=torch.int32, device=self.device)
        return torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), meta

    def _hooked(self, conn: KVConnectorWorker | None, meta: KVConnectorMetadata | None,
                meta_attn: AttentionMetadata, kv: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> contextlib.AbstractContextManager[None]:
        """The connector's per-layer hooks for this step (none unless its metadata asks): a wait before each
        layer runs, a save after its attention wrote K and V; then the model runs layer by layer (the fused
        decode stack would run none of them), and the saves are waited for after the forward."""
        stack = contextlib.ExitStack()
        meta_attn.layer_by_layer = conn is not None and meta is not None and meta.per_layer
        if not meta_attn.layer_by_layer:
            return stack
        for i, (layer, (kc, vc)) in enumerate(zip(self.model.layers, kv, strict=True)):
            stack.enter_context(layer.attn.register_forward_pre_hook(_before(conn, i)))
            stack.enter_context(layer.attn.register_forward_hook(_after(conn, i, kc, vc)))
        stack.callback(conn.wait_for_save)
        return stack

    def _decode_tables(self, tables: list[list[int]], lens: list[int]) -> torch.Tensor:
        """The int32 block table of each decode query, zero-padded to the longest (what every attention path reads:
        the kernels in place, the eager paths through :attr:`AttentionMetadata.decode_slots`)."""
        nblk = -(-max(lens) // self.block_size)
        bt = torch.zeros(len(tables), nblk, dtype=torch.int32)
        for i, (tbl, n) in enumerate(zip(tables, lens, strict=True)):
            k = -(-n // self.block_size)
            bt[i, :k] = torch.tensor(tbl[:k], dtype=torch.int32)
        return bt.to(self.device)


def _before(conn: KVConnectorWorker, i: int) -> Callable[..., None]:
    def hook(*_: object) -> None:
        conn.wait_for_layer_load(i)

    return hook


def _after(conn: KVConnectorWorker, i: int, kc: torch.Tensor, vc: torch.Tensor) -> Callable[..., None]:
    def hook(*_: object) -> None:
        conn.save_kv_layer(i, kc, vc)

    return hook

"""A Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3) in plain PyTorch over a paged KV cache.

The model sees a flat batch: every scheduled token of every sequence in one ``[T]`` tensor. Linear layers
run once over all ``T`` tokens; only attention is per group (all decode tokens batched together, each
prefill chunk on its own), reading keys and values from the paged cache through slot indices that the
model runner computed once per step (:class:`AttentionMetadata`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from fleetllm.engine.step_pause import StepPause
from fleetllm.kernels import chunk_rows, kernel_ready, kv8, paged_attention
from fleetllm.kernels.decode_stack import DecodeStack, chunk_in_place
from fleetllm.kernels.prefill import prefill_attention, prefill_ready
from fleetllm.lora.batch import LoraBatch
from fleetllm.models.config import ModelConfig
from fleetllm.models.eager_attention import eager_attention
from fleetllm.models.moe import MoE
from fleetllm.models.rope import rope_tables, rotary_dim


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk: tokens ``[start, end)`` of the flat batch, attending to ``ctx_slots``."""

    start: int
    end: int
    ctx_slots: torch.Tensor  # [context_len] flat cache slots, the chunk's own tokens last
    fresh: bool  # no cached context before the chunk: plain causal attention on the chunk itself
    window: int | None = None  # sliding-window layers: each query sees only its last ``window`` positions
    block_table: torch.Tensor | None = None  # [blocks] int32, for kernels that read the cache blocks in place
    context_len: int = 0  # positions before the chunk's end (``ctx_slots`` before a window cut them)


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes, and what each query reads (computed once per step)."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of every new token
    decode_idx: torch.Tensor | None = None  # [Bd] positions in the flat batch of single-token queries
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_tables: torch.Tensor | None = None  # [Bd, max_blocks] int32 block table of each decode query
    decode_lens: torch.Tensor | None = None  # [Bd] int32 context length of each decode query, its own token included
    block_size: int = 0
    window: int | None = None  # a sliding-window layer's view: decode queries see their last ``window`` positions
    layer_by_layer: bool = False  # something watches each layer's K/V as it is written (P/D): no fused decode stack
    mask_dtype: torch.dtype = torch.float32  # the eager paths' scores' dtype (the model's)
    pause: StepPause | None = None  # set by the engine's runner: the C stack may stop between layers for it
    _decode_keys: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    @property
    def decode_slots(self) -> torch.Tensor:
        """``[Bd, L]`` cache slots the decode queries read on the eager paths (kernels read the tables in place)."""
        return self._keys()[0]

    @property
    def decode_mask(self) -> torch.Tensor:
        """``[Bd, 1, 1, L]`` additive mask (0 or -inf) over :attr:`decode_slots`: padding, and keys out of the window."""
        return self._keys()[1]

    def _keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Built on first use, from the first position any decode query of this view sees: a sliding-window
        layer's view gathers and masks its window only, however long the context."""
        if self._decode_keys is None:
            bs, lens = self.block_size, self.decode_lens.long()
            first = max(0, int(lens.min()) - self.window) if self.window else 0
            pos = torch.arange(first, int(lens.max()), device=lens.device)
            slots = self.decode_tables.long()[:, pos // bs] * bs + pos % bs  # [Bd, L]
            last = (lens - 1).unsqueeze(1)  # each query's own position
            seen = pos.unsqueeze(0) <= last
            if self.window:
                seen &= pos.unsqueeze(0) > last - self.window
            mask = torch.zeros(seen.shape, dtype=self.mask_dtype, device=lens.device).masked_fill(~seen, float("-inf"))
            self._decode_keys = slots, mask.view(len(lens), 1, 1, -1)
        return self._decode_keys

    def within_window(self, positions: torch.Tensor, window: int) -> AttentionMetadata:
        """The same step seen by a sliding-window layer: each query reads its last ``window`` positions.

        KV stays cached for every position and layer, so block contents, block hashes (tokens only), the
        prefix cache and KV events are the same as without a window; only what a query reads changes.
        Context entirely out of every query's window is never gathered nor masked, so long contexts cost these
        layers nothing: decode queries' keys start at the window (:attr:`decode_slots`), prefill chunks' slots
        are cut, and the kernels take the window itself.
        """
        view = replace(self, prefills=[], window=window)
        for c in self.prefills:
            n_q, n_ctx = c.end - c.start, c.ctx_slots.shape[0]
            first = max(0, n_ctx - n_q - window + 1)  # the chunk's first query sees nothing before this
            view.prefills.append(replace(c, ctx_slots=c.ctx_slots[first:], window=window))
        return view


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding in the HF "rotate half" layout, cos/sin tables precomputed (:mod:`.rope`).

    With a ``partial_rotary_factor`` below 1 only each head's first dimensions rotate.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Computed on the CPU even inside the loader's meta-device context: these are no weights (``init_rotary``
        # moves them), and arithmetic on meta tensors imports ``torch._dynamo`` (seconds of a cold start).
        with torch.device("cpu"):
            cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.partial = rotary_dim(cfg) < cfg.head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]; tables stay fp32 for accuracy
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        if self.partial:
            r = cos.shape[-1]
            return (torch.cat([_rotate(q[..., :r], cos, sin), q[..., r:]], dim=-1),
                    torch.cat([_rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1))
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    # Chunks of at most this many query-position pairs also read the cache through the paged decode kernel (0:
    # only chunks of up to KERNEL_MAX_CHUNK queries, or KERNEL_MAX_CHUNK_8BIT over an 8-bit cache). A batch-invariant ``q4`` copy sets the decode stack's bound
    # (``MAX_CHUNK_KEYS``), so a short prompt's attention is the same whether its step went through the stack or
    # op by op (a P/D prefill worker, a step the stack refuses): one kernel per row, not one per step shape.
    in_place_chunk_keys = 0

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.attention_bias)
        self.o = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = (cfg.query_pre_attn_scalar or self.d) ** -0.5
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2; with sinks, only the eager path computes these
        self.sinks = nn.Parameter(torch.empty(self.h), requires_grad=False) if cfg.attention_sinks else None

    @property
    def eager(self) -> bool:
        """Whether attention writes its scores out (soft-capping, sinks): no kernel or SDPA computes them."""
        return self.softcap is not None or self.sinks is not None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        lora: tuple[LoraBatch, int] | None = None,
    ) -> torch.Tensor:
        """``lora``: the step's adapters and this layer's index, when any row has an adapter."""
        t = x.shape[0]
        qkv = self.qkv(x)
        if lora is not None:
            nq, nkv = self.h * self.d, self.hkv * self.d
            lora[0].add(lora[1], (("q_proj", 0, nq), ("k_proj", nq, nq + nkv), ("v_proj", nq + nkv, nq + 2 * nkv)),
                        x, qkv)
        q, k, v = qkv.split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k, v = q.view(t, self.h, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, positions)
        # a narrower cache (--kv-cache-dtype) stores rounded (8-bit: quantised) K/V; eager reads convert them back
        kv8.store(k_cache, meta.slot_mapping, k)
        kv8.store(v_cache, meta.slot_mapping, v)

        out = torch.empty(t, self.h, self.d, dtype=x.dtype, device=x.device)
        if self.eager:
            eager_attention(q, k_cache, v_cache, meta, self.scale, self.softcap, self.sinks, out)
            return self._out(out.view(t, self.h * self.d), lora)
        if meta.decode_idx is None:
            pass
        elif meta.decode_tables is not None and kernel_ready(q, k_cache):
            self._decode_paged(q, meta, k_cache, v_cache, out)
        else:
            out[meta.decode_idx] = self._decode(q[meta.decode_idx], meta, k_cache, v_cache)
        for c in meta.prefills:
            qc = q[c.start : c.end]
            if self._chunk_in_place(c, qc, k_cache):
                rows, lens = chunk_rows(c.end - c.start, c.context_len)
                paged_attention(qc, k_cache, v_cache, c.block_table.view(1, -1), lens, self.scale, meta.block_size,
                                c.window, table_of=rows, out=out[c.start : c.end])
            elif c.block_table is not None and prefill_ready(qc, k_cache):
                prefill_attention(qc, k_cache, v_cache, c.block_table, c.context_len, self.scale, meta.block_size,
                                  c.window, out=out[c.start : c.end])
            else:
                out[c.start : c.end] = self._prefill(qc, k[c.start : c.end], v[c.start : c.end], c, k_cache, v_cache)
        return self._out(out.view(t, self.h * self.d), lora)

    def _out(self, attn: torch.Tensor, lora: tuple[LoraBatch, int] | None) -> torch.Tensor:
        """The output projection, with each row's adapter update."""
        y = self.o(attn)
        if lora is not None:
            lora[0].add(lora[1], (("o_proj", 0, y.shape[-1]),), attn, y)
        return y

    def _chunk_in_place(self, c: PrefillChunk, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether a chunk reads the cache through the paged decode kernel (``KERNEL_MAX_CHUNK``,
        ``in_place_chunk_keys``)."""
        short = chunk_in_place(c.end - c.start, c.context_len, c.fresh, self.in_place_chunk_keys, k_cache.dtype)
        return short and c.block_table is not None and kernel_ready(q, k_cache)

    def _decode_paged(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor) -> None:
        args = (k_cache, v_cache, meta.decode_tables, meta.decode_lens, self.scale, meta.block_size, meta.window)
        if meta.decode_idx.shape[0] == q.shape[0]:  # a pure decode step: read q and write out in place
            paged_attention(q, *args, out=out)
        else:
            out[meta.decode_idx] = paged_attention(q[meta.decode_idx], *args)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # One query per sequence: group the query heads that share a KV head so K/V are never repeated.
        b = q.shape[0]
        g = self.h // self.hkv
        # index_select on the flat slots, not k_cache[decode_slots]: the same rows, several times faster on CPU
        flat, shape = meta.decode_slots.flatten(), (b, meta.decode_slots.shape[1], self.hkv, self.d)
        keys = kv8.read(k_cache, flat, q.dtype).view(shape).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
        vals = kv8.read(v_cache, flat, q.dtype).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
        qg = q.view(b, self.hkv, g, self.d)
        scores = torch.matmul(qg, keys) * self.scale + meta.decode_mask  # [B, Hkv, G, L]
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, vals).reshape(b, self.h, self.d)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: PrefillChunk, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        n_q, n_ctx = q.shape[0], c.ctx_slots.shape[0]
        if c.fresh and (c.window is None or n_q <= c.window):
            kt, vt = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            kt = kv8.read(k_cache, c.ctx_slots, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vt = kv8.read(v_cache, c.ctx_slots, q.dtype).transpose(0, 1).unsqueeze(0)
            q_pos = torch.arange(n_ctx - n_q, n_ctx, device=q.device).unsqueeze(1)
            kv_pos = torch.arange(n_ctx, device=q.device).unsqueeze(0)
            mask = kv_pos <= q_pos  # [q, L]
            if c.window is not None:
                mask &= kv_pos > q_pos - c.window
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.inter = intermediate_size or cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down = nn.Linear(self.inter, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"  # GeGLU (Gemma) instead of SwiGLU

    def forward(self, x: torch.Tensor, lora: tuple[LoraBatch, int] | None = None) -> torch.Tensor:
        """``lora``: the step's adapters and this layer's index, when any row has an adapter."""
        gu = self.gate_up(x)
        if lora is not None:
            lora[0].add(lora[1], (("gate_proj", 0, self.inter), ("up_proj", self.inter, 2 * self.inter)), x, gu)
        gate, up = gu.split(self.inter, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        mid = act * up
        y = self.down(mid)
        if lora is not None:
            lora[0].add(lora[1], (("down_proj", 0, y.shape[-1]),), mid, y)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.sliding = cfg.is_sliding(index)  # attends to the last ``cfg.sliding_window`` positions only
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)


class LlamaModel(nn.Module):
    """Decoder stack + LM head. ``forward`` returns final hidden states of every scheduled token.

    With ``aux_layers`` it also returns the outputs of those decoder layers, concatenated per token
    (``[T, len(aux_layers) * hidden]``): the features an EAGLE-style draft head reads.
    """

    decode_stack: DecodeStack | None = None  # set on ``q4`` copies by ``quantize_model``

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = uninitialised_embedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        aux_layers: tuple[int, ...] | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``lora``: each row's adapter (None: every row the base model's)."""
        h = self.embed(input_ids)
        stack = self.decode_stack  # q4's decode steps in one C call (fleetllm/kernels/decode_stack.py)
        fused = stack is not None and aux_layers is None and not meta.layer_by_layer and stack.supports(lora)
        rows = stack.plan(h, meta, kv_cache[0][0], self.rotary) if fused else None
        if rows is not None:
            stack.run(h, positions, meta, kv_cache, self.rotary, rows, lora)
            return self.norm(h)
        aux = []
        # sliding-window layers read each query's window only (AttentionMetadata.within_window)
        local = meta.within_window(positions, self.cfg.sliding_window) if self.cfg.sliding_window else meta
        for i, (layer, (kc, vc)) in enumerate(zip(self.layers, kv_cache, strict=True)):
            m = local if layer.sliding else meta
            at = (lora, i) if lora is not None else None
            h = h + layer.attn(layer.input_norm(h), positions, self.rotary, m, kc, vc, at)
            x = layer.post_attn_norm(h)
            h = h + (layer.mlp(x, at) if at is not None and isinstance(layer.mlp, MLP) else layer.mlp(x))
            if aux_layers and i in aux_layers:
                aux.append(h)
        if aux_layers is None:
            return self.norm(h)
        return self.norm(h), torch.cat(aux, dim=-1)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def init_rotary(self, device: str | torch.device | None = None) -> None:
        """(Re)build the RoPE tables on ``device`` in fp32 (after loading: they are no weights)."""
        self.rotary = Rotary(self.cfg).to(device)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Take weights named as in HF transformers' Llama/Qwen checkpoints, fusing qkv and gate/up.

        The checkpoint's tensors become the parameters (see :func:`set_weight`): only fused weights are copied.
        """
        from fleetllm.models.hf_weights import load_layer

        take = state_taker(sd)
        with torch.no_grad():
            load_embeddings(self, sd, take)
            for i, layer in enumerate(self.layers):
                load_layer(layer, self.cfg, f"model.layers.{i}.", take, sd)
        check_all_used(sd)


def uninitialised_embedding(cfg: ModelConfig) -> nn.Embedding:
    """The token embedding without a random init: its weights always come from a checkpoint, and
    ``nn.Embedding``'s ``normal_`` on the meta device imports ``torch._dynamo`` (seconds of a cold start)."""
    return nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))


def set_weight(module: nn.Module, value: torch.Tensor, name: str = "weight") -> None:
    """Make ``value`` the module's parameter ``name``, in place of the meta-device placeholder.

    No copy: a tensor memory-mapped from a safetensors file stays mapped (its pages are the page cache's,
    shared by every worker of the node, read on first use), where ``copy_`` into allocated parameters
    read the whole file into a second buffer.
    """
    expected = getattr(module, name).shape
    if value.shape != expected:
        raise ValueError(f"checkpoint weight of shape {tuple(value.shape)} where the model has {tuple(expected)}")
    setattr(module, name, nn.Parameter(value, requires_grad=False))


def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of ``parts`` as one tensor: a view when they lie back to back in one storage, else one copy.

    A safetensors file sorts its tensors by name, so a layer's ``gate_proj`` is followed by its ``up_proj``
    (four fifths of the fused bytes: no copy); ``q_proj``, ``k_proj``, ``v_proj`` are not in that order and are
    read once, straight from the map into the fused tensor.
    """
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    adjacent = all(
        b.untyped_storage().data_ptr() == storage and b.dtype == first.dtype and b.shape[1:] == first.shape[1:]
        and a.is_contiguous() and b.is_contiguous() and b.data_ptr() == a.data_ptr() + a.nbytes
        for a, b in zip(parts, parts[1:], strict=False))
    if not adjacent:
        return torch.cat(parts)
    rows = sum(t.shape[0] for t in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def state_taker(sd: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """Pops weights out of ``sd`` as fp32 (no copy when they are), so whatever is left over was not used."""
    return lambda name: sd.pop(name).to(torch.float32)


def load_embeddings(model: nn.Module, sd: dict[str, torch.Tensor], take: Callable[[str], torch.Tensor], norm_offset: float = 0.0) -> None:
    """Token embeddings, final norm and LM head (tied to the embeddings when the checkpoint has none).

    A tied checkpoint may store the shared tensor under either name: safetensors' ``save_model`` (what
    transformers' own saving falls back to) keeps ``lm_head.weight`` and drops ``model.embed_tokens.weight``.
    """
    if model.cfg.tie_word_embeddings and "model.embed_tokens.weight" not in sd and "lm_head.weight" in sd:
        sd["model.embed_tokens.weight"] = sd.pop("lm_head.weight")
    set_weight(model.embed, take("model.embed_tokens.weight"))
    set_weight(model.norm, take("model.norm.weight") + norm_offset)
    head = sd.pop("lm_head.weight", None)
    if model.cfg.tie_word_embeddings or head is None:
        model.lm_head.weight = model.embed.weight
    else:
        set_weight(model.lm_head, head.float())


def load_attention_and_mlp(layer: nn.Module, cfg: ModelConfig, p: str, take: Callable[[str], torch.Tensor], norm_offset: float = 0.0) -> None:
    """One decoder layer's attention and MLP weights (HF names under prefix ``p``), q/k/v and gate/up fused.

    See :func:`fuse` for when that copies.
    ``norm_offset``: added to the q/k norm weights (1 for Gemma, whose checkpoints store ``weight - 1``).
    """
    a = layer.attn
    set_weight(a.qkv, fuse([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
    if cfg.attention_bias:
        set_weight(a.qkv, fuse([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]), "bias")
    set_weight(a.o, take(p + "self_attn.o_proj.weight"))
    if cfg.qk_norm:
        set_weight(a.q_norm, take(p + "self_attn.q_norm.weight") + norm_offset)
        set_weight(a.k_norm, take(p + "self_attn.k_norm.weight") + norm_offset)
    set_weight(layer.mlp.gate_up, fuse([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
    set_weight(layer.mlp.down, take(p + "mlp.down_proj.weight"))


def check_all_used(sd: dict[str, torch.Tensor]) -> None:
    unused = [k for k in sd if "rotary_emb" not in k]
    if unused:
        raise ValueError(f"unexpected weights in checkpoint: {unused[:5]}")

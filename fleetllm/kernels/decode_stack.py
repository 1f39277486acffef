"""A decode step through a ``q4`` Llama decoder stack in one C call (``decode_stack.c``).

At narrow steps the arithmetic of a layer is a few hundred microseconds of GEMV, and PyTorch's op-by-op
dispatch of everything around it (norms, RoPE, splits, cache writes, residual adds: about forty ops a layer)
cost as much again. :class:`DecodeStack` holds layer tables for the C function, which runs every layer for
every row of a step, calling a GEMM and the paged attention kernel of their own libraries (passed as function
pointers, so each kernel has one source): the Q4 one (int16 or int8 activations) and, for steps as wide as the
linears' bf16 bound (``q4`` on a CPU with AVX-512 BF16), the bf16 one over the linears' bf16 weights. A step
is taken when every row is a decode token or a query of a chunk whose queries × positions stay under
``MAX_CHUNK_KEYS`` or of at most ``KERNEL_MAX_CHUNK`` queries over cached context (speculative verification,
short prompts; see :func:`chunk_in_place`); any other step (a long prompt's prefill, as many
rows as the stack's bound or more, a kernel not built, a model it does not cover) takes the model's op-by-op
path. ``FLEETLLM_DECODE_STACK=eager`` keeps every step there.

A Q8_0 GGUF of a mixture-of-experts model (Qwen3-MoE, served under ``q4``: its Q8_0 linears kept, their narrow steps
on the Q8_0 GEMV) takes the stack too: Q8_0 attention projections (``q8_gemv.c``'s ``q8_i16_gemv``: activations
rounded to int16 per group of 32, as the Q4_1 linears'), Qwen3's per-head q/k norms,
and each layer's experts through ``moe_experts.c`` (:class:`fleetllm.kernels.moe_experts.FusedExperts`: router,
top-k, the chosen experts, their sum), whose per-expert row counts the step hands back to each layer's
``expert_counts`` (the load-imbalance metrics). Such a model takes the stack below its linears' Q8_0 bound (the
rows from which they multiply by dequantised weights instead).

Steps whose rows use LoRA adapters pass the resident adapters' tables (:class:`fleetllm.lora.tables.LoraTables`)
and each row's slot: the C step adds each row's update through ``lora.c`` where the op-by-op path adds it (see
the C source). The per-layer pointers into the tables are made again whenever the tables' ``version`` moves.

Numerics: the same weights and the same GEMMs as the op-by-op ``q4`` path at each width, and its attention kernel
for decode rows (a chunk the stack takes may go through the prefill kernel op by op, unless batch-invariant);
RMSNorm and SiLU round differently from PyTorch's (summation order, a polynomial ``exp``), RoPE the same. So a
token's logits differ from the op-by-op path's by float rounding, as ``q4``'s already differ from fp32's.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fleetllm.kernels import attention, bf16, kv8, moe_experts, q4_int, q8
from fleetllm.kernels.build import KernelLibrary
from fleetllm.kernels.lora import LIBRARY as LORA_LIBRARY
from fleetllm.kernels.lora import kernel_ready as lora_kernel_ready
from fleetllm.lora.tables import MODULES, LoraTables

if TYPE_CHECKING:
    from fleetllm.engine.step_pause import StepPause

_enabled = os.environ.get("FLEETLLM_DECODE_STACK", "auto") != "eager"
# A chunk (a prompt's, or a longer verification's) is taken while queries x positions stays under this: the paged
# kernel reads each key once for a chunk's queries but runs each query's softmax and value pass over all of them,
# where the op-by-op path's prefill kernel (or SDPA) works on a tile of queries (git log -p BENCHMARKS.md, "Paged attention kernel": the kernel wins at 1-2 queries over 1,024
# positions); e.g. 8 queries over 2,048 positions, or a 128-token prompt with nothing cached. A batch-invariant
# q4 model keeps such chunks on the paged kernel off the stack too (``Attention.in_place_chunk_keys``).
MAX_CHUNK_KEYS = 16384
# Chunks over cached context of at most this many queries (speculative verification of a few drafts) read the cache
# through the paged kernel at any context, on the stack and off it: the kernel reads each key once for all of a
# chunk's queries. Longer ones (and every fresh prompt) take the prefill kernel off the stack, which reads each key
# once per tile of queries, or gather + SDPA where it cannot run (benchmarks/paged_attention.py).
KERNEL_MAX_CHUNK = 3
# An 8-bit cache's chunks also share each widened key vector among their queries (paged_attention.c,
# scores_avx512_rows), so the paged kernel keeps the lead to longer verifications: 2 sequences verifying up to 4
# drafts each at 4,300 / 7,500 tokens of context, one thread, int8: 78.7 -> 64.8 / 109.6 -> 94.4 ms a step with 5
# rather than 3 (fp32 at 4,300: 104.4 -> 108.0, so fp32 keeps 3; 2026-12-06, in-process, under the lock).
KERNEL_MAX_CHUNK_8BIT = 5


def kernel_max_chunk(kv_dtype: torch.dtype | None) -> int:
    """The most queries of a chunk over cached context that read a ``kv_dtype`` cache through the paged kernel."""
    return KERNEL_MAX_CHUNK_8BIT if kv_dtype in kv8.QMAX else KERNEL_MAX_CHUNK


def chunk_in_place(queries: int, context_len: int, fresh: bool, max_keys: int,
                   kv_dtype: torch.dtype | None = None) -> bool:
    """Whether a chunk of ``queries`` queries ending at ``context_len`` positions reads a ``kv_dtype`` cache through
    the paged kernel: a verification's few queries over cached context (:func:`kernel_max_chunk`), or at most
    ``max_keys`` query-position pairs (the stack's ``MAX_CHUNK_KEYS``, ``Attention.in_place_chunk_keys`` off it)."""
    return (queries <= kernel_max_chunk(kv_dtype) and not fresh) or queries * context_len <= max_keys
P, INT, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
LINEARS = ("qkv", "o", "gate_up", "down")


class _Q4(ctypes.Structure):
    _fields_ = [("packed", P), ("d", P), ("m", P)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", P), ("norm2", P), ("qkv", _Q4), ("o", _Q4), ("gate_up", _Q4), ("down", _Q4), ("q8", INT),
                ("q_norm", P), ("k_norm", P), ("moe", P)]


class _LoraLayer(ctypes.Structure):
    _fields_ = [("a", P * len(MODULES)), ("b", P * len(MODULES))]


class _Model(ctypes.Structure):
    _fields_ = [("layers", P), ("n_layers", INT), ("hidden", INT), ("heads", INT), ("kv_heads", INT), ("head_dim", INT),
                ("inter", INT), ("block_size", INT), ("kv_dtype", INT), ("eps", FLOAT), ("scale", FLOAT), ("cos", P),
                ("sin", P), ("gemv", P), ("attend", P), ("lora", P), ("gemv8", P), ("moe", P)]


class _Step(ctypes.Structure):
    _fields_ = [("h", P), ("rows", INT), ("threads", INT), ("positions", P), ("slots", P), ("tables", P), ("lens", P),
                ("table_of", P), ("table_stride", INT), ("k_caches", P), ("v_caches", P), ("scratch", P),
                ("lora", P), ("lora_slots", P), ("lora_n_slots", INT), ("lora_rank", INT), ("counts", P),
                ("count_stride", INT), ("pause", P), ("first_layer", INT), ("next_layer", INT)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.decode_stack.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    lib.decode_stack.restype = INT
    lib.decode_stack_isa.restype = INT
    lib.decode_stack_store.argtypes = [P, INT, P, P, INT, INT, INT]
    lib.decode_stack_store.restype = None


LIBRARY = KernelLibrary(Path(__file__).with_name("decode_stack.c"), _declare)


@dataclass(frozen=True)
class Rows:
    """What each row of a step reads: block tables, each row's table (None: row i reads table i) and its
    context length (its own position included; a chunk's queries end at 1, 2, ... past the cached context)."""

    tables: torch.Tensor  # [tables, max_blocks] int32
    table_of: torch.Tensor | None  # [rows] int32
    lens: torch.Tensor  # [rows] int32

    @classmethod
    def of(cls, meta: Any, rows: int, kv_dtype: torch.dtype | None = None) -> Rows | None:
        """The rows of a step of decode tokens and short chunks over a ``kv_dtype`` cache; None for any other step."""
        n_dec = 0 if meta.decode_idx is None else meta.decode_idx.shape[0]
        if n_dec and meta.decode_tables is None:
            return None
        if not meta.prefills:
            ok = n_dec == rows
            return cls(meta.decode_tables.to(torch.int32).contiguous(), None, meta.decode_lens.to(torch.int32).contiguous()) if ok else None
        chunks = meta.prefills
        if any(c.block_table is None or c.window is not None
               or not chunk_in_place(c.end - c.start, c.context_len, c.fresh, MAX_CHUNK_KEYS, kv_dtype) for c in chunks) or n_dec + sum(c.end - c.start for c in chunks) != rows:
            return None
        tables = [*(meta.decode_tables.tolist() if n_dec else []), *(c.block_table.tolist() for c in chunks)]
        width = max(len(t) for t in tables)
        table_of, lens = [0] * rows, [0] * rows
        if n_dec:
            for i, (r, n) in enumerate(zip(meta.decode_idx.tolist(), meta.decode_lens.tolist(), strict=True)):
                table_of[r], lens[r] = i, n
        for i, c in enumerate(chunks):
            first = c.context_len - (c.end - c.start)
            for j in range(c.end - c.start):
                table_of[c.start + j], lens[c.start + j] = n_dec + i, first + j + 1
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        return cls(padded, torch.tensor(table_of, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32))


def _q4(linear: Any) -> Any:
    """The ``Q4Linear`` of a ``q4`` linear (itself, or the narrow side of a ``ByWidth``), else None."""
    module = getattr(linear, "narrow", linear)
    return module if isinstance(getattr(module, "q4", None), q4_int.BlockedQ4) else None


def _paired(linear: Any) -> bf16.PairedBF16 | None:
    """The bf16 weight of a ``q4`` linear's wide steps (the wide side of a ``ByWidth``), else None."""
    weight = getattr(getattr(linear, "wide", None), "w16", None)
    return weight if isinstance(weight, bf16.PairedBF16) else None


def _q8(linear: Any) -> q8.Q8Weight | None:
    """The Q8_0 weight of a linear kept as Q8_0 whose narrow steps take the Q8_0 GEMV (a ``q4`` copy of a
    ``PackedQ8Linear``), else None."""
    packed = getattr(linear, "packed", None)
    return packed if isinstance(packed, q8.Q8Weight) and getattr(linear, "q8_rows", 0) > 0 else None


def _struct(w: q4_int.BlockedQ4 | bf16.PairedBF16 | q8.Q8Weight | None) -> _Q4:
    if w is None:  # gate_up and down of a layer with experts
        return _Q4(None, None, None)
    if isinstance(w, bf16.PairedBF16):
        return _Q4(w.paired.data_ptr(), None, None)
    if isinstance(w, q8.Q8Weight):
        return _Q4(w.q.data_ptr(), w.d.data_ptr(), None)
    return _Q4(w.blocked.data_ptr(), w.d.data_ptr(), w.m.data_ptr())


def _table(layers: list[dict[str, Any]], kind: str) -> ctypes.Array:
    """The C layer table over ``layers``' weights of ``kind`` ("q4": the narrow steps' Q4_1 or Q8_0, or "bf16":
    the wide steps')."""
    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    return (_Layer * len(layers))(*(
        _Layer(ly["norm1"].data_ptr(), ly["norm2"].data_ptr(), *(_struct(ly[kind].get(name)) for name in LINEARS),
               int(ly["q8"]), ptr(ly["q_norm"]), ptr(ly["k_norm"]), ly["moe"].address if ly["moe"] else None)
        for ly in layers))


def _layer_entry(layer: Any) -> dict[str, Any] | None:
    """One decoder layer's weights for the C table, or None when the stack does not cover it (see ``build``)."""
    attn, mlp = layer.attn, layer.mlp
    if type(layer).__name__ != "DecoderLayer" or getattr(layer, "sliding", False) or getattr(attn, "eager", False):
        return None  # sliding windows, soft-capping, sinks: the C step has none of them
    if getattr(attn.o, "bias", None) is not None or getattr(attn.qkv, "bias", None) is not None:
        return None
    experts = hasattr(mlp, "router")
    moe = moe_experts.FusedExperts.of(mlp) if experts and mlp.shared is None and mlp.q8_rows > 0 else None
    if (experts and moe is None) or (not experts and getattr(mlp, "gelu", True)):
        return None
    linears = {"qkv": attn.qkv, "o": attn.o, **({} if experts else {"gate_up": mlp.gate_up, "down": mlp.down})}
    q4s, q8s = {k: _q4(v) for k, v in linears.items()}, {k: _q8(v) for k, v in linears.items()}
    is_q8 = all(w is not None for w in q8s.values())
    if not is_q8 and any(q is None for q in q4s.values()):
        return None
    q_norm, k_norm = (getattr(getattr(attn, n, None), "weight", None) for n in ("q_norm", "k_norm"))
    return {"q4": q8s if is_q8 else {k: q.q4 for k, q in q4s.items()}, "q8": is_q8, "modules": list(linears.values()),
            "bf16": {k: _paired(v) for k, v in linears.items()}, "norm1": layer.input_norm.weight,
            "norm2": layer.post_attn_norm.weight, "q_norm": q_norm, "k_norm": k_norm, "moe": moe,
            "moe_module": mlp if experts else None}


def _lora_table(tables: LoraTables) -> ctypes.Array:
    """Per layer, the A/B pointers of each projection a resident adapter adapts (NULL for the others)."""
    def pointers(layer: int, side: list[dict[str, torch.Tensor]]) -> Any:
        on = [tables.active[m] and m in side[layer] for m in MODULES]
        return (P * len(MODULES))(*(side[layer][m].data_ptr() if ok else None for m, ok in zip(MODULES, on, strict=True)))

    return (_LoraLayer * tables.num_layers)(*(_LoraLayer(pointers(i, tables.a), pointers(i, tables.b))
                                              for i in range(tables.num_layers)))


class DecodeStack:
    """The C path for one ``q4`` Llama model's decode steps and short chunks; :meth:`build` says whether it covers it."""

    def __init__(self, model: Any, layers: list[dict[str, Any]], max_rows: int, bits: int, bf16_rows: int | None) -> None:
        cfg, attn = model.cfg, model.layers[0].attn
        self.max_rows, self.bits, self.bf16_rows = max_rows, bits, bf16_rows
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.q8 = any(ly["q8"] for ly in layers)
        self.moes = [ly["moe_module"] if ly["moe"] else None for ly in layers]  # each layer's MoE block (None: dense)
        self.num_experts = max((m.num_experts for m in self.moes if m is not None), default=0)
        # scratch per row for the MLP's gate_up output, which also holds a layer's experts' sum
        self.mlp_scratch = max(2 * self.inter, cfg.hidden_size if self.num_experts else 0)
        self.width = (attn.h + 2 * attn.hkv) * attn.d
        self.q_width = attn.h * attn.d
        self._keep = layers  # every weight pointer below points into these
        self._tables = {kind: _table(layers, kind) for kind in ("q4", "bf16") if kind == "q4" or bf16_rows}
        self._model = _Model(None, len(layers), cfg.hidden_size, attn.h, attn.hkv, attn.d,
                             cfg.intermediate_size, 0, 0, cfg.rms_norm_eps, attn.scale, None, None, None, None)
        self._caches: dict[tuple[int, ...], tuple[Any, Any]] = {}
        # per set of LoRA tables (an engine's): their version and the C pointer table into them
        self._lora: weakref.WeakKeyDictionary[LoraTables, tuple[int, ctypes.Array]] = weakref.WeakKeyDictionary()

    @classmethod
    def build(cls, model: Any, max_rows: int) -> DecodeStack | None:
        """The stack for ``model`` (a ``q4`` copy of a Llama model, or of a Q8_0 GGUF's Qwen3-MoE), or None when any
        layer is not covered: a linear that is neither Q4_1 nor Q8_0 on its GEMV, attention biases, GeGLU, experts
        the fused kernel does not take (a shared expert, GPT-OSS's), sliding windows, soft-capping or sinks, or a
        non-fp32 or non-contiguous tensor."""
        if not hasattr(model, "layers") or not hasattr(model, "rotary") or getattr(model.rotary, "partial", False):
            return None
        layers = [_layer_entry(layer) for layer in model.layers]
        if any(ly is None for ly in layers):
            return None
        modules = [m for ly in layers for m in ly["modules"]]
        bits = {_q4(m).bits for m in modules if _q4(m) is not None}
        tensors = [t for ly in layers for k in ("norm1", "norm2", "q_norm", "k_norm") if (t := ly[k]) is not None]
        if len(bits) > 1 or any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                                for t in tensors):
            return None
        q8_rows = [m.q8_rows for m in modules if _q8(m) is not None]  # Q8_0 linears: below their fp32 bound only
        max_rows = min([max_rows, *q8_rows, *(ly["moe_module"].q8_rows for ly in layers if ly["moe"])])
        # a bf16 table where every linear has bf16 weights for its wide steps, all taking them from one width
        widths = {getattr(m, "rows", None) for m in modules}
        paired = len(widths) == 1 and all(_paired(m) is not None for m in modules)
        return cls(model, layers, max_rows, bits.pop() if bits else 0, widths.pop() if paired else None)

    @staticmethod
    def supports(lora: Any) -> bool:
        """Whether a step whose rows' adapters are ``lora`` (a :class:`fleetllm.lora.batch.LoraBatch`, None: the
        base model's step) may take the C path: with adapter rows, once the LoRA kernel is loaded (CPU tables)."""
        if lora is None or not lora.has_adapters:
            return True
        return lora.tables.device.type == "cpu" and lora.slots.device.type == "cpu" and lora_kernel_ready()

    def plan(self, h: torch.Tensor, meta: Any, k_cache: torch.Tensor, rotary: Any) -> Rows | None:
        """The step's rows for the C path, or None when the step must go op by op (see the module doc)."""
        rows = h.shape[0]
        if not _enabled or rows >= self.max_rows or meta.window is not None:
            return None
        if h.dtype != torch.float32 or h.device.type != "cpu" or k_cache.dtype not in attention.KV_DTYPES:
            return None
        if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
               for t in (rotary.cos, rotary.sin)):
            return None
        libs = (LIBRARY.get(), attention.LIBRARY.get() if attention.kernel_enabled() else None)
        if any(lib is None for lib in libs) or LIBRARY.lib.decode_stack_isa() != 2:
            return None
        if (self.bits and not q4_int.kernel_ready()) or (self.q8 and not q8.kernel_ready()) or (
                self.num_experts and not moe_experts.kernel_ready()):
            return None
        return Rows.of(meta, rows, k_cache.dtype)

    def run(self, h: torch.Tensor, positions: torch.Tensor, meta: Any,
            kv_cache: list[tuple[torch.Tensor, torch.Tensor]], rotary: Any, rows: Rows, lora: Any = None) -> None:
        """Every layer over ``h [rows, hidden]`` in place (``rows`` from :meth:`plan`); RoPE from ``rotary``'s tables;
        each row's adapter update from ``lora`` (a :class:`fleetllm.lora.batch.LoraBatch` that :meth:`supports`)."""
        n = h.shape[0]
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        scratch = torch.empty(n * (self.hidden + self.width + self.q_width + self.mlp_scratch + self.inter))
        k_ptrs, v_ptrs = self._cache_pointers(kv_cache)
        md = _Model.from_buffer_copy(self._model)  # per call: engines sharing this model may run at once
        md.block_size, md.kv_dtype = meta.block_size, attention.KV_DTYPES[kv_cache[0][0].dtype]
        md.cos, md.sin = rotary.cos.data_ptr(), rotary.sin.data_ptr()
        wide = self.bf16_rows is not None and n >= self.bf16_rows and bf16.kernel_ready()
        md.layers = ctypes.addressof(self._tables["bf16" if wide else "q4"])
        if self.bits:
            md.gemv = ctypes.cast(bf16.LIBRARY.lib.bf16_gemm if wide else q4_int.gemm_function(self.bits), P).value
        md.attend = ctypes.cast(attention.LIBRARY.lib.paged_attention, P).value
        counts = self._with_experts(md)
        table_of = None if rows.table_of is None else rows.table_of.data_ptr()
        step = _Step(h.data_ptr(), n, torch.get_num_threads(), positions.data_ptr(), slots.data_ptr(),
                     rows.tables.data_ptr(), rows.lens.data_ptr(), table_of, rows.tables.stride(0),
                     ctypes.addressof(k_ptrs), ctypes.addressof(v_ptrs), scratch.data_ptr())
        keep = self._with_lora(md, step, lora)  # noqa: F841 - alive until the call returns
        if counts is not None:
            step.counts, step.count_stride = counts.data_ptr(), self.num_experts
        self._call(md, step, meta.pause)
        if counts is not None:
            for moe, row in zip(self.moes, counts.tolist(), strict=True):
                if moe is not None:
                    moe._count(row[: moe.num_experts])

    @staticmethod
    def _call(md: _Model, step: _Step, pause: StepPause | None) -> None:
        """Run the step's layers; when ``pause`` stops it between two layers, let it run what it must and resume where the step stopped (``step.h`` is its whole state)."""
        step.pause = pause.address() if pause is not None else None
        while True:
            rc = LIBRARY.lib.decode_stack(ctypes.byref(md), ctypes.byref(step))
            if rc != 0:
                raise RuntimeError(f"decode_stack failed with status {rc}")
            if step.next_layer >= md.n_layers:
                return
            pause.pause()
            step.first_layer = step.next_layer

    def _with_experts(self, md: _Model) -> torch.Tensor | None:
        """Fill the call's Q8_0 GEMV and experts kernel; the per-layer expert counts the step fills (None: no
        experts)."""
        if self.q8:
            md.gemv8 = ctypes.cast(q8.LIBRARY.lib.q8_i16_gemv, P).value
        if not self.num_experts:
            return None
        md.moe = ctypes.cast(moe_experts.LIBRARY.lib.moe_experts, P).value
        return torch.zeros(len(self.moes), self.num_experts, dtype=torch.int64)

    def _with_lora(self, md: _Model, step: _Step, lora: Any) -> Any:
        """Fill the call's LoRA fields when a row uses an adapter a projection has; returns what must stay alive."""
        tables = None if lora is None or not lora.has_adapters else lora.tables
        if tables is None or tables.rank == 0 or not any(tables.active.values()):
            return None
        if LORA_LIBRARY.lib is None:
            raise RuntimeError("a step with adapter rows needs the LoRA kernel: supports() checks it")
        slots = lora.slots.to(torch.int32).contiguous()
        version, table = self._lora.get(tables, (-1, None))
        if version != tables.version:
            table = _lora_table(tables)
            self._lora[tables] = (tables.version, table)
        md.lora = ctypes.cast(LORA_LIBRARY.lib.lora_apply, P).value
        step.lora, step.lora_slots = ctypes.addressof(table), slots.data_ptr()
        step.lora_n_slots, step.lora_rank = tables.max_loras, tables.rank
        return slots, table

    def _cache_pointers(self, kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, Any]:
        """The per-layer K and V cache pointer arrays, made once per set of caches (an engine's)."""
        key = tuple(t.data_ptr() for pair in kv_cache for t in pair)
        if key not in self._caches:
            n = len(kv_cache)
            self._caches[key] = ((P * n)(*(k.data_ptr() for k, _ in kv_cache)), (P * n)(*(v.data_ptr() for _, v in kv_cache)))
        return self._caches[key]


def store_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x [T, kv_heads, head_dim]`` into ``cache`` at ``slots`` with the C step's own writer (``cache``
    contiguous, in a dtype of ``attention.KV_DTYPES``): what a step through the stack stores for its rows."""
    slots, x = slots.to(torch.int64).contiguous(), x.float().contiguous()
    LIBRARY.lib.decode_stack_store(cache.data_ptr(), attention.KV_DTYPES[cache.dtype], slots.data_ptr(), x.data_ptr(),
                                   x.shape[0], x.shape[1] * x.shape[2], x.shape[2])


def set_enabled(enabled: bool) -> None:
    """Let decode steps and short chunks take the C path (True, the default) or keep them op by op (False)."""
    global _enabled
    _enabled = enabled

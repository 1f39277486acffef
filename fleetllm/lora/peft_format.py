"""A PEFT LoRA adapter read from its directory (``adapter_config.json`` + ``adapter_model.safetensors``) and checked
against the base model and the engine's limits before anything is loaded.

What is taken: LoRA on the decoder's q/k/v/o and gate/up/down projections, any rank up to ``max_lora_rank``,
scaling ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), per-module ``rank_pattern`` and
``alpha_pattern``. Everything else PEFT can save that changes the model's output is refused by name (DoRA,
``modules_to_save``, LoRA biases, trained tokens, layer replication, ...), as are target modules the model lacks,
expert projections of a mixture-of-experts model, and weights whose shapes are not this model's. The weights decide
what is adapted (``target_modules`` is checked, not trusted): a key that is not a decoder projection's ``lora_A`` or
``lora_B`` is refused by name.

A differing ``base_model_name_or_path`` is logged, not refused: served names rarely equal the hub id or local path
an adapter was trained from (``smollm2-135m`` vs ``HuggingFaceTB/SmolLM2-135M``), so refusing on it would refuse
adapters that fit; what makes an adapter unusable is its shapes, and those are checked tensor by tensor.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fleetllm.lora.errors import LoraError
from fleetllm.lora.tables import MODULES, Shapes, SlotWeights

log = logging.getLogger(__name__)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_MLP = ("gate_proj", "up_proj", "down_proj")
# PEFT options that change the adapted model's output in ways this engine does not compute; refused when set
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "lora_bias": "LoRA biases (lora_bias)", "trainable_token_indices": "trained token embeddings",
    "layer_replication": "layer_replication", "target_parameters": "target_parameters (adapted nn.Parameters)",
    "use_qalora": "QA-LoRA (use_qalora)", "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D weights)", "use_bdlora": "BD-LoRA (use_bdlora)",
}
# PEFT adapts a mixture-of-experts model's fused expert weights as parameters (``mlp.experts.gate_up_proj``)
_EXPERT_PARAM = re.compile(r"(^|\.)(experts|gate_up_proj|down_proj|w1|w2|w3)($|\.)")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class ModelSpec:
    """What an adapter must fit: the base model's name, layers, projection shapes and mixture-of-experts layers."""

    name: str
    num_layers: int
    shapes: Shapes
    moe_layers: frozenset[int] = frozenset()

    @classmethod
    def of(cls, cfg: Any, name: str) -> ModelSpec:
        """From a :class:`fleetllm.models.config.ModelConfig`."""
        shapes = Shapes.of(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)
        moe = frozenset(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
        return cls(name, cfg.num_layers, shapes, moe)

    def module_names(self) -> list[str]:
        """Every module name an adapter may target (HF's names), the head and embeddings included for checks."""
        names = ["model.embed_tokens", "lm_head"]
        for i in range(self.num_layers):
            names += [f"model.layers.{i}.{_parent(m)}.{m}" for m in MODULES]
        return names


@dataclass
class Adapter:
    """One adapter's weights, ready for :meth:`fleetllm.lora.tables.LoraTables.set_slot` with scaling 1: each
    ``b`` already carries its module's scaling."""

    path: Path
    rank: int
    modules: frozenset[str]
    weights: dict[tuple[int, str], SlotWeights]
    base_model: str | None

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def read_adapter(path: str | Path, spec: ModelSpec, max_rank: int) -> Adapter:
    """Read and check the adapter at ``path``; raise :class:`LoraError` (400) naming the first problem found."""
    root = Path(path)
    if not root.is_dir():
        raise LoraError(f"no adapter directory at {str(path)!r}")
    cfg = _read_config(root)
    _check_options(cfg, max_rank)
    _check_targets(cfg.get("target_modules"), spec)
    base = cfg.get("base_model_name_or_path")
    if base and Path(str(base)).name.lower() != spec.name.lower() and str(base) != spec.name:
        log.info("adapter %s was trained from %r, served on %r: its shapes are checked, not its base's name", root,
                 base, spec.name)
    pairs = _pairs(_read_tensors(root), spec)
    if not pairs:
        raise LoraError(f"{root / WEIGHTS} holds no LoRA weights")
    weights = {key: _scaled(key, a, b, cfg, max_rank) for key, (a, b) in pairs.items()}
    _check_shapes(weights, spec)
    rank = max(w.a.shape[0] for w in weights.values())
    return Adapter(root, rank, frozenset(m for _, m in weights), weights, base)


def _read_config(root: Path) -> dict[str, Any]:
    if not (root / CONFIG).is_file():
        raise LoraError(f"{root} has no {CONFIG}: not a PEFT adapter directory")
    try:
        cfg = json.loads((root / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{root / CONFIG} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{root / CONFIG} is not a JSON object")
    return cfg


def _check_options(cfg: dict[str, Any], max_rank: int) -> None:
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoraError(f"peft_type {kind!r} is not supported: only LoRA adapters are")
    experts = [t for t in cfg.get("target_parameters") or [] if isinstance(t, str) and _EXPERT_PARAM.search(t)]
    if experts:
        raise LoraError(f"expert projections of a mixture-of-experts model are not supported (target_parameters "
                        f"{experts})")
    for key, what in UNSUPPORTED.items():
        if cfg.get(key):
            raise LoraError(f"{what} is not supported (adapter_config.json sets {key})")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"bias {cfg['bias']!r} is not supported: only adapters trained with bias='none' are")
    ranks = {"r": cfg.get("r", 8), **{f"rank_pattern[{k!r}]": v for k, v in (cfg.get("rank_pattern") or {}).items()}}
    for where, r in ranks.items():
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise LoraError(f"{where} = {r!r} is not a positive integer rank")
        if r > max_rank:
            raise LoraError(f"adapter rank {r} ({where}) exceeds --max-lora-rank {max_rank}")
    alphas = [cfg.get("lora_alpha", 8), *(cfg.get("alpha_pattern") or {}).values()]
    if any(not isinstance(a, int | float) or isinstance(a, bool) for a in alphas):
        raise LoraError(f"lora_alpha must be a number, not {alphas!r}")


def _check_targets(targets: Any, spec: ModelSpec) -> None:
    """``target_modules`` must name projections this model has (PEFT's list of names or suffixes, or a regex)."""
    if targets is None or targets == "all-linear":
        return
    names = spec.module_names()
    if isinstance(targets, str):
        hits = [n for n in names if re.fullmatch(targets, n)]
        if not hits:
            raise LoraError(f"target_modules {targets!r} matches no projection of this model")
        targets = hits
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoraError(f"target_modules must be a list of names or a regex string, not {targets!r}")
    for t in targets:
        short = t.rsplit(".", 1)[-1]
        if short in ("lm_head", "embed_tokens"):
            raise LoraError(f"target module `{t}` is not supported: adapters apply to the decoder's projections only")
        if short not in MODULES:
            raise LoraError(f"target module `{t}` is not a projection of this model (it has {', '.join(MODULES)})")
        if short in _MLP and spec.moe_layers and len(spec.moe_layers) == spec.num_layers:
            raise LoraError(f"target module `{t}`: this model's MLPs are mixtures of experts, and expert projections "
                            "are not supported")


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    if not (root / WEIGHTS).is_file():
        if (root / "adapter_model.bin").is_file():
            raise LoraError("adapter_model.bin (a pickle) is not loaded: save the adapter as safetensors "
                            "(save_pretrained(..., safe_serialization=True))")
        raise LoraError(f"{root} has no {WEIGHTS}")
    from safetensors.torch import load_file

    try:
        return load_file(str(root / WEIGHTS))
    except Exception as e:  # noqa: BLE001 - a truncated or forged file: whatever the parser raises, a 400
        raise LoraError(f"{WEIGHTS} is not a readable safetensors file: {type(e).__name__}: {e}") from None


def _pairs(tensors: dict[str, torch.Tensor], spec: ModelSpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``(layer, module) -> (A, B)`` from PEFT's key names; any other key refused by name."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraError(_foreign_key(key))
        layer, parent, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in MODULES or parent != _parent(module):
            raise LoraError(f"weight `{key}`: `{parent}.{module}` is not a projection of this model")
        if layer >= spec.num_layers:
            raise LoraError(f"weight `{key}`: layer {layer} where the model has {spec.num_layers}")
        if module in _MLP and layer in spec.moe_layers:
            raise LoraError(f"weight `{key}`: layer {layer}'s MLP is a mixture of experts, and expert projections are "
                            "not supported")
        found.setdefault((layer, module), {})[ab] = t
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"layer {layer} {module}: lora_{'B' if 'A' in ab else 'A'} is missing")
    return {k: (v["A"], v["B"]) for k, v in found.items()}


def _foreign_key(key: str) -> str:
    if ".experts." in key or "shared_expert" in key:
        return f"weight `{key}`: expert projections of a mixture-of-experts model are not supported"
    if "lora_magnitude_vector" in key:
        return f"weight `{key}`: DoRA is not supported"
    if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
        return f"weight `{key}`: adapters on the embeddings or the LM head are not supported"
    return f"weight `{key}` is not a LoRA weight of a decoder projection (q/k/v/o, gate/up/down)"


def _scaled(key: tuple[int, str], a: torch.Tensor, b: torch.Tensor, cfg: dict[str, Any], max_rank: int) -> SlotWeights:
    """One projection's matrices, checked, fp32, ``b`` times its scaling (PEFT's per-module rank and alpha)."""
    layer, module = key
    name = f"model.layers.{layer}.{_parent(module)}.{module}"
    r = _pattern(cfg.get("rank_pattern"), name, cfg.get("r", 8))
    alpha = _pattern(cfg.get("alpha_pattern"), name, cfg.get("lora_alpha", 8))
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise LoraError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a rank-r pair")
    if a.shape[0] != r:
        raise LoraError(f"{name}: lora_A has rank {a.shape[0]} where adapter_config.json says r = {r}")
    if r > max_rank:
        raise LoraError(f"adapter rank {r} ({name}) exceeds --max-lora-rank {max_rank}")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise LoraError(f"{name}: LoRA weights must be floating point, not {a.dtype}/{b.dtype}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return SlotWeights(a.float().contiguous(), (b.float() * scaling).contiguous())


def _check_shapes(weights: dict[tuple[int, str], SlotWeights], spec: ModelSpec) -> None:
    for (layer, module), w in sorted(weights.items()):
        fan_in, fan_out = spec.shapes.dims[module]
        if w.a.shape[1] != fan_in or w.b.shape[0] != fan_out:
            raise LoraError(f"layer {layer} {module}: the adapter maps {w.a.shape[1]} -> {w.b.shape[0]} features "
                            f"where this model's {module} maps {fan_in} -> {fan_out}: it was made for another base "
                            "model")


def _pattern(patterns: dict[str, Any] | None, name: str, default: Any) -> Any:
    """PEFT's per-module override: the first pattern equal to ``name`` or matching a trailing part of it."""
    for key, value in (patterns or {}).items():
        if key == name or re.fullmatch(rf"(.*\.)?(?:{key})", name):
            return value
    return default


def _parent(module: str) -> str:
    return "mlp" if module in _MLP else "self_attn"

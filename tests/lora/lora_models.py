"""A tiny seeded random Llama (HF transformers) and PEFT adapters on it with random non-zero A and B, and greedy
references computed by HF + PEFT itself; also PEFT-layout adapters written directly at another model's shapes."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# the shapes of tests/families.py's tiny models: initializer_range 0.2 keeps greedy margins far above rounding
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# three adapters: different ranks, scalings and target modules (one with all seven, one with per-module patterns)
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8": dict(r=8, lora_alpha=16, target_modules=ALL, use_rslora=True),
    "mixed16": dict(r=16, lora_alpha=4, target_modules=["k_proj", "o_proj", "down_proj"],
                    rank_pattern={"k_proj": 2}, alpha_pattern={"down_proj": 24}),
}


@dataclass
class TinyLora:
    """The base model's directory and HF model, and each adapter's directory and HF + PEFT model."""

    base_dir: Path
    base: Any
    dirs: dict[str, Path] = field(default_factory=dict)
    peft: dict[str, Any] = field(default_factory=dict)

    def greedy(self, name: str | None, prompt: list[int], n: int) -> list[int]:
        """HF's greedy tokens for ``prompt`` under adapter ``name`` (None: the base model), EOS ignored."""
        model = self.base if name is None else self.peft[name]
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]


def build(root: Path, tokenizer_json: str) -> TinyLora:
    """The tiny Llama saved under ``root/base`` and the :data:`ADAPTERS` saved under ``root/<name>``."""
    import peft
    import transformers

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON), dtype=torch.float32,
                                                         attn_implementation="sdpa").eval()
    base.save_pretrained(root / "base")
    (root / "base" / "tokenizer.json").write_text(tokenizer_json)
    tiny = TinyLora(root / "base", base)
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kw))
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:  # PEFT starts B at zero: both random, so every adapted module matters
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
        model.save_pretrained(root / name)
        tiny.dirs[name], tiny.peft[name] = root / name, model.eval()
    return tiny


def write_adapter(path: Path, dims: dict[str, tuple[int, int]], layers: int, modules: list[str], r: int,
                  alpha: float, seed: int, scale: float = 0.02, **config: Any) -> Path:
    """An adapter in PEFT's layout (names, config keys) at the shapes ``dims`` (module -> (in, out)), written
    directly: for a model too big to build in HF for a test."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for m in modules:
            fan_in, fan_out = dims[m]
            key = f"base_model.model.model.layers.{i}.{'mlp' if m in ALL[4:] else 'self_attn'}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": modules, "bias": "none", **config}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path

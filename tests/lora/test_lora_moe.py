"""A mixture-of-experts model takes adapters on its attention projections (equal to HF + PEFT), and refuses
adapters on its experts by name."""

from __future__ import annotations

import copy

import pytest
import torch

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling import SamplingParams
from fleetllm.lora.errors import LoraError

PROMPT = [1, 17, 230, 45, 99, 310, 7, 88]


def test_a_moe_models_attention_adapter_equals_hf_peft_and_expert_adapters_are_refused(family_models, tmp_path) -> None:
    peft = pytest.importorskip("peft")
    path, hf = family_models.get("qwen3_moe")
    adapted = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8,
                                                                      target_modules=["q_proj", "v_proj", "o_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    adapted.save_pretrained(tmp_path / "attn")
    experts = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj"]))
    experts.save_pretrained(tmp_path / "experts")
    llm = LLM(str(path), quantization="none", enable_lora=True, num_blocks=32)
    llm.load_lora("attn", str(tmp_path / "attn"))
    with pytest.raises(LoraError, match="expert projections"):
        llm.load_lora("experts", str(tmp_path / "experts"))
    got = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), lora_name="attn")
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(adapted(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert got[0].outputs[0].token_ids == ids[len(PROMPT):]

"""Hostile or unsupported adapters are refused by name (a 400 LoraError), and an engine refusing them keeps serving."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lora_models import COMMON, write_adapter

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling import SamplingParams
from fleetllm.lora.errors import LoraError
from fleetllm.lora.peft_format import ModelSpec, read_adapter
from fleetllm.lora.tables import Shapes

SPEC = ModelSpec("tiny", COMMON["num_hidden_layers"], Shapes.of(
    COMMON["hidden_size"], COMMON["num_attention_heads"], COMMON["num_key_value_heads"],
    COMMON["hidden_size"] // COMMON["num_attention_heads"], COMMON["intermediate_size"]))


def _config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))


def _truncate(path: Path) -> None:
    f = path / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:100])


def _pickle_only(path: Path) -> None:
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")


def _other_model(path: Path) -> None:
    shutil.rmtree(path)
    write_adapter(path, Shapes.of(96, 4, 2, 24, 128).dims, 2, ["q_proj"], 4, 8, seed=1)


def _head_weight(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    t = load_file(str(path / "adapter_model.safetensors"))
    t["base_model.model.lm_head.lora_A.weight"] = torch.ones(4, 64)
    save_file(t, str(path / "adapter_model.safetensors"))


HOSTILE: dict[str, tuple[Callable[[Path], None], str]] = {
    "rank above the limit": (lambda p: _config(p, r=128, rank_pattern={}), "exceeds --max-lora-rank 64"),
    "corrupt safetensors": (_truncate, "not a readable safetensors file"),
    "target modules the model lacks": (lambda p: _config(p, target_modules=["c_attn", "q_proj"]), "`c_attn`"),
    "modules_to_save": (lambda p: _config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    "DoRA": (lambda p: _config(p, use_dora=True), "DoRA"),
    "a pickle instead of safetensors": (_pickle_only, "adapter_model.bin (a pickle) is not loaded"),
    "another base model's shapes": (_other_model, "made for another base model"),
    "a LoRA on the LM head": (_head_weight, "LM head"),
    "expert parameters (PEFT's fused MoE experts)": (lambda p: _config(p, target_parameters=["gate_up_proj"]),
                                                     "expert projections of a mixture-of-experts model"),
    "not JSON": (lambda p: (p / "adapter_config.json").write_text("{r: 4"), "not valid JSON"),
}


def _hostile(tmp_path: Path, source: Path, case: str) -> Path:
    path = tmp_path / case.replace(" ", "_")
    shutil.copytree(source, path)
    HOSTILE[case][0](path)
    return path


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_adapter_is_refused_by_name(case: str, tiny_lora, tmp_path: Path) -> None:
    with pytest.raises(LoraError) as e:
        read_adapter(_hostile(tmp_path, tiny_lora.dirs["qv4"], case), SPEC, 64)
    assert (e.value.status, HOSTILE[case][1] in e.value.message) == (400, True), e.value.message


def test_expert_projections_of_a_mixture_of_experts_model_are_refused_by_name(tmp_path: Path) -> None:
    moe = ModelSpec("tiny-moe", 2, SPEC.shapes, frozenset({0, 1}))
    path = write_adapter(tmp_path / "a", SPEC.shapes.dims, 2, ["gate_proj"], 4, 8, seed=2)
    with pytest.raises(LoraError, match="expert projections are not supported"):
        read_adapter(path, moe, 64)


def test_rslora_and_per_module_patterns_set_each_modules_scaling(tiny_lora) -> None:
    adapter = read_adapter(tiny_lora.dirs["mixed16"], SPEC, 64)  # r 16 alpha 4; k_proj r 2; down_proj alpha 24
    peft = tiny_lora.peft["mixed16"].base_model.model.model.layers[1]
    for module, layer_module, scale in (("k_proj", peft.self_attn.k_proj, 4 / 2), ("o_proj", peft.self_attn.o_proj,
                                        4 / 16), ("down_proj", peft.mlp.down_proj, 24 / 16)):
        assert layer_module.scaling["default"] == scale
        w = adapter.weights[(1, module)]
        assert w.a.shape[0] == layer_module.lora_A["default"].weight.shape[0]
        assert (w.b - layer_module.lora_B["default"].weight * scale).abs().max() == 0


def test_an_engine_refusing_hostile_adapters_keeps_serving(tiny_lora, tmp_path: Path) -> None:
    llm = LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, num_blocks=32)
    llm.load_lora("qv4", str(tiny_lora.dirs["qv4"]))
    for case in HOSTILE:
        with pytest.raises(LoraError):
            llm.load_lora("bad", str(_hostile(tmp_path, tiny_lora.dirs["qv4"], case)))
    prompt, params = [1, 40, 41, 42, 43], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in llm.generate([prompt, prompt], params, lora_name=[None, "qv4"])]
    assert llm.engine.lora_names() == ["qv4"]
    assert got == [tiny_lora.greedy(None, prompt, 4), tiny_lora.greedy("qv4", prompt, 4)]


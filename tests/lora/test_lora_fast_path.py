"""The default fast path (q4, op-by-op with adapters) agrees with exact mode under adapters, as q4 must without:
the same greedy tokens on the reference prompts (tests/models/test_fast_path_quality.py's bar)."""

from __future__ import annotations

from pathlib import Path

from kernel_checks import require_kernels
from lora_models import ALL, write_adapter

from fleetllm.bench.quality import REFERENCE_PROMPTS, prompt_ids
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling import SamplingParams
from fleetllm.lora.peft_format import ModelSpec


def test_q4_with_adapters_agrees_with_exact_mode(loaded_model, tmp_path: Path) -> None:
    from fleetllm.kernels import q4, q4_int

    require_kernels(q4.LIBRARY, q4_int.LIBRARY)
    cfg = loaded_model.config
    dims = ModelSpec.of(cfg, "m").shapes.dims
    dirs = {"qv16": write_adapter(tmp_path / "qv16", dims, cfg.num_layers, ["q_proj", "v_proj"], 16, 32, seed=1,
                                  scale=0.05),
            "all8": write_adapter(tmp_path / "all8", dims, cfg.num_layers, ALL, 8, 16, seed=2, scale=0.04)}
    prompts = prompt_ids(loaded_model.tokenizer, REFERENCE_PROMPTS[:1] + REFERENCE_PROMPTS[-1:], raw_from=1)
    jobs = [(p, n) for p in prompts for n in (None, *dirs)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for quant in ("none", "q4"):
        llm = LLM(loaded=loaded_model, quantization=quant, enable_lora=True, num_blocks=64)
        for name, path in dirs.items():
            llm.load_lora(name, str(path))
        res = llm.generate([p for p, _ in jobs], params, lora_name=[n for _, n in jobs])
        outs[quant] = [r.outputs[0].token_ids for r in res]
    assert outs["q4"] == outs["none"]
    base = outs["none"][0::3]
    assert all(outs["none"][k::3] != base for k in (1, 2))  # the adapters change the output

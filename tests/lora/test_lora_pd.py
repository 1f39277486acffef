"""P/D with adapters: a frame carries its adapter, is imported under that adapter's block keys, and serves only
requests of that adapter on the decode side."""

from __future__ import annotations

from fleetllm.disagg import frame
from fleetllm.disagg.kv_io import export_blocks, import_blocks
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling import SamplingParams

PROMPT = [1, *range(200, 240)]  # two full blocks and some
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_an_adapters_kv_moved_between_engines_serves_that_adapter_only(tiny_lora) -> None:
    a, b = (LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, num_blocks=64) for _ in range(2))
    for llm in (a, b):
        llm.load_lora("qv4", str(tiny_lora.dirs["qv4"]))
    local = a.generate([PROMPT], PARAMS, lora_name="qv4")[0].outputs[0].token_ids
    header, layers = export_blocks(a.engine, PROMPT, lora_name="qv4")
    moved = frame.decode(b"".join(frame.encode(header, layers)))
    assert moved[0].lora_name == "qv4" and import_blocks(b.engine, *moved)["imported"] == 2
    base = b.generate([PROMPT], PARAMS)[0]
    remote = b.generate([PROMPT], PARAMS, lora_name="qv4")[0]
    assert (base.num_cached_tokens, remote.num_cached_tokens) == (0, 32)
    assert remote.outputs[0].token_ids == local

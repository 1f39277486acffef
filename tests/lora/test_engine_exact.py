"""Exact mode with adapters: greedy output equals HF transformers + PEFT token for token, base and adapter requests
in the same batches, through hot loads, unloads and reloads."""

from __future__ import annotations

import pytest
from lora_models import ADAPTERS

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling import SamplingParams
from fleetllm.lora import batch
from fleetllm.lora.errors import LoraError

PROMPTS = [[1, 17, 230, 45, 99, 310, 7, 88, 140, 402, 33, 61, 250, 19, 5, 77, 123, 300],
           [1, 401, 12, 12, 87, 260, 3, 190]]
N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def mixed(llm: LLM, names: list[str | None]) -> dict[tuple[str | None, int], list[int]]:
    """Every prompt under every name, all submitted at once (one continuous batch)."""
    jobs = [(name, i) for name in names for i in range(len(PROMPTS))]
    res = llm.generate([PROMPTS[i] for _, i in jobs], GREEDY, lora_name=[name for name, _ in jobs])
    return {job: r.outputs[0].token_ids for job, r in zip(jobs, res, strict=True)}


@pytest.mark.parametrize("dense_rows", [64, 0], ids=["stacked", "segmented"])
def test_mixed_batches_of_base_and_three_adapters_equal_hf_peft(tiny_lora, dense_rows: int, monkeypatch) -> None:
    monkeypatch.setattr(batch, "DENSE_ROWS", dense_rows)  # narrow steps: both ways of applying the adapters
    llm = LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, max_loras=3, num_blocks=64,
              max_num_batched_tokens=40)  # prompts chunked, so prefill and decode rows of all four share steps
    for name, path in tiny_lora.dirs.items():
        llm.load_lora(name, str(path))
    got = mixed(llm, [None, *ADAPTERS])
    for (name, i), toks in got.items():
        assert toks == tiny_lora.greedy(name, PROMPTS[i], N), (name, i)
    for name in ADAPTERS:  # each adapter changes the output: the comparison above could not pass by ignoring them
        assert any(got[(name, i)] != got[(None, i)] for i in range(len(PROMPTS))), name


def test_hot_load_unload_and_reload_keep_outputs_equal_to_hf_peft(tiny_lora) -> None:
    llm = LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, max_loras=2, max_cpu_loras=0,
              num_blocks=64)  # three adapters over two slots, none kept in memory: slots evicted, reads from disk
    llm.load_lora("qv4", str(tiny_lora.dirs["qv4"]))
    mixed(llm, [None, "qv4"])
    for name in ("all8", "mixed16"):  # hot: loaded while the engine has served
        llm.load_lora(name, str(tiny_lora.dirs[name]))
    llm.unload_lora("qv4")
    with pytest.raises(LoraError) as e:
        llm.generate([PROMPTS[0]], GREEDY, lora_name="qv4")
    assert e.value.status == 404
    llm.load_lora("qv4", str(tiny_lora.dirs["qv4"]))
    got = mixed(llm, [None, *ADAPTERS])
    for (name, i), toks in got.items():
        assert toks == tiny_lora.greedy(name, PROMPTS[i], N), (name, i)
    assert llm.engine.lora.disk_reads > 0


def test_an_unknown_adapter_is_refused_with_404_before_any_step(tiny_lora) -> None:
    llm = LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, num_blocks=32)
    with pytest.raises(LoraError) as e:
        llm.engine.add_request("r", PROMPTS[0], GREEDY, lora_name="nope")
    assert (e.value.status, llm.engine.has_unfinished()) == (404, False)

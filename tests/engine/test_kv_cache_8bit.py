"""--kv-cache-dtype int8 / fp8: a quarter of fp32's bytes per token (rows with their scales), greedy output close
to an fp32 pool's, and prefix-cache hits read the 8-bit blocks as the request that wrote them did."""

from __future__ import annotations

import pytest
import torch

from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.engine.llm import LLM
from fleetllm.engine.model_runner import ModelRunner
from fleetllm.engine.params import SamplingParams
from fleetllm.kernels import kv8
from fleetllm.models.loader import LoadedModel

PROMPTS = ["Explain why the sky is blue in two sentences.", "def fibonacci(n):",
           "List three uses of copper and say why it suits each."]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_an_8bit_pool_holds_rows_of_values_and_a_scale_in_about_a_quarter_of_the_bytes(
        loaded_model: LoadedModel) -> None:
    model = loaded_model.model
    head_dim = loaded_model.config.head_dim
    fp32 = ModelRunner.kv_bytes_per_block(model, 16, torch.float32)
    width = head_dim + kv8.SCALE_BYTES * head_dim // kv8.GROUP  # the values, then a float16 scale per group
    assert ModelRunner.kv_bytes_per_block(model, 16, torch.int8) * 4 * head_dim == fp32 * width
    for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                        ("fp8_e5m2", torch.float8_e5m2)):
        k, v = LLMEngine(EngineConfig(num_blocks=32, kv_cache_dtype=name), loaded=loaded_model).kv_blocks()[0]
        assert k.dtype == v.dtype == dtype and k.shape[-1] == width


@pytest.fixture(scope="module")
def greedy(loaded_model: LoadedModel) -> dict[str, list[list[int]]]:
    """Greedy tokens of each prompt (chat template) with fp32, int8 and fp8 pools (the default q4 path: its C
    decode step writes and reads the pool)."""
    tok = loaded_model.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
           for p in PROMPTS]
    out = {}
    for d in ("fp32", "int8", "fp8"):
        llm = LLM(loaded=loaded_model, num_blocks=64, kv_cache_dtype=d)
        out[d] = [r.outputs[0].token_ids for r in llm.generate(ids, GREEDY)]
    return out


@pytest.mark.parametrize(("dtype", "tokens"), [("int8", 8), ("fp8", 4)])
def test_an_8bit_pool_agrees_with_fp32_on_the_first_greedy_tokens(greedy: dict[str, list[list[int]]], dtype: str,
                                                                  tokens: int) -> None:
    # rounding K/V flips near-ties later in a greedy run, fp8 (3 mantissa bits) sooner than int8 (the full bar, 16
    # prompts x 32 tokens and perplexity, is benchmarks/fast_path_quality.py's, docs/kv-cache-dtype.md); a broken
    # 8-bit path (a wrong scale, row or byte order) diverges from the first token
    assert [a[:tokens] for a in greedy[dtype]] == [a[:tokens] for a in greedy["fp32"]]


def test_a_prefix_cache_hit_on_8bit_blocks_gives_the_output_of_the_request_that_wrote_them(
        loaded_model: LoadedModel) -> None:
    engine = LLMEngine(EngineConfig(num_blocks=32, kv_cache_dtype="int8"), loaded=loaded_model)
    ids = engine.tokenizer.encode(" ".join(PROMPTS) * 2)
    runs = []
    for rid in ("first", "again"):
        engine.add_request(rid, ids, GREEDY)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        runs.append(([t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens))
    assert runs[0][1] == 0 and runs[1][1] == (len(ids) - 1) // 16 * 16
    assert runs[1][0] == runs[0][0]

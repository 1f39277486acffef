"""Model loading: GGUF dequantisation, llama.cpp's Q/K permutation, tokenizer, HF directories, the cache."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from safetensors.torch import save_file

from fleetllm import LLM, SamplingParams
from fleetllm.models import loader
from fleetllm.models.loader import LoadedModel, _unpermute, dequantize_tensor, resolve


class _FakeTensor:
    def __init__(self, data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> None:
        self.data, self.tensor_type, self.shape = data, qtype, list(reversed(shape))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "F16"])
def test_gguf_block_types_dequantise_to_close_fp32(qtype: str) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 256)).astype(np.float32)
    t = GGMLQuantizationType[qtype]
    q = w.astype(np.float16) if qtype == "F16" else quantize(w, t)
    out = dequantize_tensor(_FakeTensor(q, t, w.shape))
    assert out.shape == w.shape and out.dtype == np.float32
    tol = {"Q8_0": 0.01, "F16": 0.001}.get(qtype, 0.15)
    assert np.linalg.norm(out - w) / np.linalg.norm(w) < tol


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    heads, head_dim, cols = 3, 8, 5
    w = torch.randn(heads * head_dim, cols)
    # convert_hf_to_gguf: reshape(n_head, 2, rows/n_head/2, ...).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(_unpermute(permuted, heads), w)


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(FileNotFoundError, match="smollm2-135m"):
        resolve("no-such-model")


@pytest.mark.slow
def test_tokenizer_from_gguf_matches_transformers(loaded_model: LoadedModel) -> None:
    transformers = pytest.importorskip("transformers")
    from hf_reference import hf_reference_dir

    ref = transformers.AutoTokenizer.from_pretrained(str(hf_reference_dir()))  # transformers' reading of the GGUF
    tok = loaded_model.tokenizer
    for text in ["Hello, world!", "  leading spaces\tand tabs\n\nnewlines", "digits 1234567 and 3.14159",
                 "émoji 🚀 and 中文", "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2  # square"]:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
def test_dequantised_cache_round_trips(loaded_model: LoadedModel) -> None:
    gguf = Path(resolve("smollm2-135m"))
    assert (loader.dequant_cache_dir(gguf) / "done").exists(), "the session's first load wrote the cache"
    cfg1, fresh, tok1 = loader._dequantise_gguf(gguf)
    cfg2, sd2, tok2 = loader.read_gguf(gguf)  # mapped from the cache
    assert cfg1 == cfg2 and sd2.keys() == {name for name, _, _ in fresh}
    # the first and last tensors in file order (embeddings, layer 0, the last layer, the norm) made afresh:
    # every tensor would be the whole dequantisation again (tens of seconds of CPU) for the same check
    for name, shape, make in fresh[:4] + fresh[-4:]:
        assert sd2[name].shape == shape and torch.equal(torch.cat(list(make())).view(shape), sd2[name]), name
    text = "<|im_start|>user\nWhat is 12+30?<|im_end|>"
    assert tok1.encode(text) == tok2.encode(text) and tok1.chat_template == tok2.chat_template


def test_loads_of_one_gguf_at_the_same_time_dequantise_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 loaded_model: LoadedModel) -> None:
    monkeypatch.setenv("FLEETLLM_CACHE_DIR", str(tmp_path))
    calls = []

    def slow_dequantise(path: Path):  # stands in for tens of seconds of NumPy; the others must wait, not redo it
        calls.append(path)
        time.sleep(0.5)
        return loaded_model.config, [("w", (4,), lambda: [torch.arange(2.0), torch.arange(2.0, 4.0)])], loaded_model.tokenizer

    monkeypatch.setattr(loader, "_dequantise_gguf", slow_dequantise)
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: loader.read_gguf(resolve("smollm2-135m")), range(3)))
    assert len(calls) == 1
    assert all(torch.equal(sd["w"], torch.arange(4.0)) for _, sd, _ in results)


@pytest.mark.slow
def test_hf_directory_gives_the_same_greedy_output_as_the_gguf(loaded_model: LoadedModel) -> None:
    from hf_reference import hf_reference_dir

    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompt = "The three primary colours are"
    a = LLM(loaded=loaded_model, kv_cache_gb=0.25).generate([prompt], params)[0].outputs[0].token_ids
    # the HF directory transformers saved from the same GGUF: its weights, config.json and tokenizer files
    b = LLM(str(hf_reference_dir()), kv_cache_gb=0.25).generate([prompt], params)[0].outputs[0].token_ids
    assert a == b


def test_safetensors_map_gives_the_file_tensors_and_fuses_adjacent_ones_without_a_copy(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from fleetllm.models.llama import fuse
    from fleetllm.models.safetensors_mmap import map_safetensors

    g = torch.Generator().manual_seed(0)
    names = ("mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj")
    save_file({n + ".weight": torch.randn(4, 3, generator=g) for n in names}
              | {"bf16": torch.ones(2, dtype=torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    mapped, read = map_safetensors(tmp_path / "m.safetensors"), load_file(str(tmp_path / "m.safetensors"))
    assert {k: (v.dtype, v.tolist()) for k, v in mapped.items()} == {k: (v.dtype, v.tolist()) for k, v in read.items()}
    gate, up = mapped["mlp.gate_proj.weight"], mapped["mlp.up_proj.weight"]
    gate_up = fuse([gate, up])  # back to back in the file (sorted by name): a view of the map
    assert gate_up.data_ptr() == gate.data_ptr() and torch.equal(gate_up, torch.cat([gate, up]))
    qkv = fuse([mapped[f"self_attn.{n}_proj.weight"] for n in "qkv"])  # k, q, v in the file: one copy
    assert qkv.data_ptr() != mapped["self_attn.q_proj.weight"].data_ptr()
    assert torch.equal(qkv, torch.cat([read[f"self_attn.{n}_proj.weight"] for n in "qkv"]))


def test_without_a_writable_cache_the_weights_are_made_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  loaded_model: LoadedModel) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the cache dir's parent is a file: every write fails
    monkeypatch.setenv("FLEETLLM_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(loader, "_dequantise_gguf", lambda path: (
        loaded_model.config, [("w", (2, 2), lambda: [torch.ones(1, 2), torch.zeros(1, 2)])], loaded_model.tokenizer))
    _, sd, _ = loader.read_gguf(resolve("smollm2-135m"))
    assert torch.equal(sd["w"], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))

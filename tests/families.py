"""Tiny, seeded, random-initialised HF transformers models of each family fleetllm runs, built once per session.

Each is saved as safetensors with the embedded SmolLM2 tokenizer (the loader needs one; prompts are token ids
below the tiny vocabulary). ``initializer_range`` 0.2 keeps the greedy choice's margin well above float rounding.
Sliding windows are 12 positions, shorter than the longer prompts, so windows cut both prefill and decode.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hf_reference import cache_lock

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
WINDOW = 12
FULL_VOCAB = 49152  # SmolLM2's
LLAMA_CPP = (Path(os.environ.get("FLEETLLM_PEERS_DIR", Path.home() / ".cache" / "fleetllm-peers"))
             / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp")  # unpacked by scripts/setup.sh


def _configs(t: Any) -> dict[str, Callable[[], Any]]:
    moe = dict(num_experts_per_tok=2)
    return {
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**COMMON, **moe, num_experts=8, moe_intermediate_size=32,
                                              norm_topk_prob=True, head_dim=32),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**COMMON, **moe, num_experts=8, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48),
        "mixtral": lambda: t.MixtralConfig(**COMMON, **moe, num_local_experts=4, sliding_window=None),
        "mistral": lambda: t.MistralConfig(**COMMON, sliding_window=WINDOW),
        "phi3": lambda: t.Phi3Config(**COMMON, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 48,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
        "gemma2": lambda: t.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16),
        "gpt_oss": lambda: t.GptOssConfig(**{**COMMON, "intermediate_size": 32}, **moe, num_local_experts=4,
                                          head_dim=16, sliding_window=WINDOW),
    }


FAMILIES = ("gemma2", "gpt_oss", "mistral", "mixtral", "phi3", "qwen2_moe", "qwen3_moe")
MOE_FAMILIES = ("gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe")
# soft-capping and sinks are what HF's eager attention computes (its SDPA path drops them)
_EAGER = ("gemma2", "gpt_oss")


class FamilyModels:
    """``get(family)`` -> (directory, HF model), each built on first use and kept for the session."""

    def __init__(self, root: Path, tokenizer_json: str) -> None:
        self.root, self.tokenizer_json = root, tokenizer_json
        self._built: dict[str, tuple[Path, Any]] = {}

    def get(self, family: str) -> tuple[Path, Any]:
        if family not in self._built:
            self._built[family] = self._build(family)
        return self._built[family]

    def _build(self, family: str, overrides: dict[str, Any] | None = None, name: str = "") -> tuple[Path, Any]:
        import transformers

        torch.manual_seed(0)
        cfg = _configs(transformers)[family]()
        for k, v in (overrides or {}).items():
            setattr(cfg, k, v)
        impl = "eager" if family in _EAGER else "sdpa"
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=impl)
        target = self.root / (name or family)
        model.eval().save_pretrained(target)
        if overrides:
            _converter_tokenizer(family, target)
        else:
            (target / "tokenizer.json").write_text(self.tokenizer_json)
        return target, model

    def gguf(self, family: str, outtype: str) -> tuple[Path, Any]:
        """The family's model with the tokenizer's whole vocabulary and tied embeddings (llama.cpp's converter wants
        every token id to have a row), converted to GGUF ``outtype`` by llama.cpp's own ``convert_hf_to_gguf.py``;
        the conversion (~5 s, mostly its imports) is kept per machine, keyed by the weights' SHA-256."""
        path, model = self.gguf_source(family)
        return convert_to_gguf(path, outtype), model

    def gguf_source(self, family: str) -> tuple[Path, Any]:
        """The HF directory :meth:`gguf` converts, and its model."""
        key = f"{family}-full-vocab"
        if key not in self._built:
            overrides = {**GGUF_OVERRIDES.get(family, _DEFAULT_GGUF), "tie_word_embeddings": True}
            self._built[key] = self._build(family, overrides, key)
        return self._built[key]

    def gguf_mxfp4(self) -> tuple[Path, Any]:
        """The GPT-OSS model with its experts in MXFP4 as OpenAI's checkpoints hold them (``*_blocks``, ``*_scales``,
        ``quantization_config.quant_method: mxfp4``), converted by llama.cpp's converter (which keeps them MXFP4);
        and the HF model with those experts as transformers' own MXFP4 reading dequantises them."""
        path, model = self.mxfp4_source()
        return convert_to_gguf(path, "f32"), model

    def mxfp4_source(self) -> tuple[Path, Any]:
        """The HF directory :meth:`gguf_mxfp4` converts, and its model."""
        key = "gpt_oss-mxfp4"
        if key not in self._built:
            self._built[key] = self._build("gpt_oss", {"vocab_size": FULL_VOCAB, "tie_word_embeddings": True}, key)
            _to_mxfp4(*self._built[key])
        return self._built[key]

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# What a family's GGUF model changes. The vocabulary: SmolLM2's whole one (its tokenizer files tell llama.cpp's
# converter which pre-tokenizer it is), but Gemma 2's, whose converter reads a SentencePiece model only: a small one
# trained here. Mistral's window: llama.cpp's converter writes Mistral as ``llama`` without it (llama.cpp runs it with
# full attention), so its GGUF equals HF's Mistral where the window covers the context (4096: Mistral 7B v0.1's).
GGUF_OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma2": {"vocab_size": 512},
    "mistral": {"vocab_size": FULL_VOCAB, "sliding_window": 4096},
}
_DEFAULT_GGUF = {"vocab_size": FULL_VOCAB}


def _converter_tokenizer(family: str, target: Path) -> None:
    """The tokenizer files llama.cpp's converter reads for ``family``."""
    if family == "gemma2":
        (target / "tokenizer.model").write_bytes(sentencepiece_model())
        return
    import json

    from hf_reference import hf_reference_dir

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_reference_dir() / f, target / f)
    if family == "phi3":  # its converter takes a BPE tokenizer only by this class (Phi-4's), else SentencePiece
        config = json.loads((target / "tokenizer_config.json").read_text())
        (target / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))


def sentencepiece_model() -> bytes:
    """A 320-piece SentencePiece BPE model (byte fallback) trained on a fixed text: deterministic, ~20 ms."""
    import io

    import sentencepiece

    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jovial kings".split()
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(200)]
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out, vocab_size=320,
                                             model_type="bpe", byte_fallback=True, minloglevel=2, num_threads=1)
    return out.getvalue()


_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 by code


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., rows, K]`` as MXFP4 in HF's layout: blocks of 32 along K, each a power-of-two scale (the byte
    ``127 + e``, the block's largest magnitude over 4 rounded down to a power of two) and 32 e2m1 codes of the nearest
    values, two a byte, the even element in the low nibble: (``[..., rows, K/32, 16]``, ``[..., rows, K/32]``) uint8."""
    b = w.reshape(*w.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax))
    codes = (b / 2.0**e).unsqueeze(-1).sub(torch.tensor(_FP4)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (e.squeeze(-1) + 127).to(torch.uint8)


@torch.no_grad()
def _to_mxfp4(path: Path, model: Any) -> None:
    """Rewrite the saved GPT-OSS checkpoint's experts as MXFP4 and set ``model``'s to what transformers reads back."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    sd, params = load_file(path / "model.safetensors"), dict(model.named_parameters())
    for name in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4(sd.pop(name).transpose(1, 2).contiguous())  # blocks run along each output's inputs
        sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
        params[name].copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))


@torch.no_grad()
def hf_greedy_logprobs(model: Any, prompt: list[int], out: list[int]) -> torch.Tensor:
    """HF's log-probabilities ``[len(out), vocab]`` at each output position, computed as its ``generate`` does: the
    prompt in one pass, then one token at a time over its KV cache (what Phi-3's longrope chooses depends on it)."""
    res = model(torch.tensor([prompt]), use_cache=True)
    rows, past = [res.logits[0, -1]], res.past_key_values
    with warnings.catch_warnings():  # transformers 5.25 renames past_key_values for some families only
        warnings.simplefilter("ignore", FutureWarning)
        for tok in out[:-1]:
            res = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            rows.append(res.logits[0, -1])
            past = res.past_key_values
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def converter() -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py`` where scripts/setup.sh unpacked it, or None."""
    script = LLAMA_CPP / "convert_hf_to_gguf.py"
    return script if script.exists() else None


def convert_to_gguf(model_dir: Path, outtype: str) -> Path:
    """``model_dir`` converted by llama.cpp's script (its own gguf-py), cached under the fleetllm cache."""
    return convert_many([(model_dir, outtype)])[0]


def convert_many(jobs: list[tuple[Path, str]]) -> list[Path]:
    """Each ``(model_dir, outtype)`` converted by llama.cpp's script, cached under the fleetllm cache: the missing
    ones in one converter process (``gguf_convert_many.py``), each entry's lock held meanwhile."""
    from fleetllm.models.source import cache_dir

    targets = []
    for model_dir, outtype in jobs:
        digest = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()[:16]
        targets.append(cache_dir() / "gguf-families" / f"{model_dir.name}-{digest}-{outtype}.gguf")
    with contextlib.ExitStack() as locks:
        for target in sorted(set(targets)):  # one order for every process: none waits on another's held lock
            locks.enter_context(cache_lock(target))
        todo = {t: job for t, job in zip(targets, jobs, strict=True) if not t.exists()}
        args = []
        for target, (model_dir, outtype) in todo.items():
            for stale in target.parent.glob(f"{target.name}.*.tmp"):  # a killed conversion's (we hold the lock)
                stale.unlink()
            args += [str(model_dir), outtype, str(target.with_name(f"{target.name}.{os.getpid()}.tmp"))]
        if todo:
            subprocess.run([sys.executable, str(Path(__file__).with_name("gguf_convert_many.py")), str(converter()),
                            *args], check=True, capture_output=True, timeout=600, preexec_fn=_die_with_parent)
        for target in todo:
            os.replace(target.with_name(f"{target.name}.{os.getpid()}.tmp"), target)
    return targets


def _die_with_parent() -> None:
    """The converter ends with whoever started it (the session's background preparation is killed at its end)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG



def q8_0(w: torch.Tensor) -> torch.Tensor:
    """``w`` rounded as llama.cpp's Q8_0 stores it: blocks of 32 along each row, ``round(x / d)`` with
    ``d = max|x| / 127`` (halves away from zero), ``d`` kept in fp16."""
    b = w.reshape(-1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    scaled = b * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    a = scaled.abs()
    q = torch.sign(scaled) * (a.floor() + (2 * (a - a.floor())).floor())
    return (d.half().float() * q).reshape(w.shape)


GGUF_CASES = (("qwen3_moe", "f32"), ("qwen3_moe", "q8_0"), ("qwen2_moe", "f32"), ("mixtral", "f32"), ("mixtral", "q8_0"),
              ("gpt_oss", "f32"), ("mistral", "f32"), ("phi3", "f32"), ("gemma2", "f32"))  # what tests read


def prepare_ggufs() -> None:
    """Convert every GGUF the tests read into the per-machine cache (the suite runs this from its start, in the
    background: tests/conftest.py); a test that gets there first waits on the entry's lock instead."""
    import tempfile

    if converter() is None:
        return
    with tempfile.TemporaryDirectory() as d:
        models = FamilyModels(Path(d), "")
        jobs = [(models.gguf_source(family)[0], outtype) for family, outtype in GGUF_CASES]
        convert_many([*jobs, (models.mxfp4_source()[0], "f32")])


if __name__ == "__main__":
    prepare_ggufs()


def requantise(src: Path, dst: Path, qtypes: dict[str, Any]) -> dict[str, Any]:
    """``src`` (an F32 GGUF) rewritten to ``dst`` with each tensor whose name holds a key of ``qtypes`` quantised
    to that type by gguf-py (llama.cpp's ``llama-quantize`` is not built here); returns the fp32 weights those
    tensors now stand for (gguf-py's dequantisation), by GGUF name, in PyTorch layout."""
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    rounded = {}
    for t in reader.tensors:
        qtype = next((q for key, q in qtypes.items() if key in t.name), None)
        if qtype is None:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        data = quantize(np.asarray(t.data, dtype=np.float32), qtype)
        rounded[t.name] = torch.from_numpy(dequantize(data, qtype).copy())
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return rounded

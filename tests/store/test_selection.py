"""Only the files the loader reads are fetched."""

import pytest

from fleetllm.store.errors import StoreError
from fleetllm.store.selection import needed_files

HF_REPO = ["README.md", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
           "pytorch_model.bin", "onnx/model.onnx", "original/consolidated.safetensors"]


def test_hf_layout_takes_safetensors_config_and_tokenizer_only():
    assert needed_files(HF_REPO, "m") == [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]


def test_tokenizer_alone_skips_the_weights():
    assert needed_files(HF_REPO, "m", weights=False) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def test_named_gguf_out_of_many():
    names = ["a.Q4_K_M.gguf", "a.Q8_0.gguf", "README.md"]
    assert needed_files(names, "m", file="a.Q8_0.gguf") == ["a.Q8_0.gguf"]
    with pytest.raises(StoreError, match="2 GGUF files; name one"):
        needed_files(names, "hf://o/a")


def test_repo_without_weights_is_refused():
    with pytest.raises(StoreError, match="neither"):
        needed_files(["README.md", "pytorch_model.bin"], "m")

"""The tiny Llama and its three PEFT adapters (tests/lora/lora_models.py), built once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lora_models import TinyLora, build


@pytest.fixture(scope="session")
def tiny_lora(tmp_path_factory: pytest.TempPathFactory, loaded_model) -> Iterator[TinyLora]:
    pytest.importorskip("peft")
    yield build(tmp_path_factory.mktemp("lora"), loaded_model.tokenizer.tok.to_str())

"""The tiny HF models of every family (tests/models/families.py), built once per session on first use."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from families import FamilyModels

if TYPE_CHECKING:
    from fleetllm.models.loader import LoadedModel


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory, loaded_model: LoadedModel) -> Iterator[FamilyModels]:
    pytest.importorskip("transformers")
    models = FamilyModels(tmp_path_factory.mktemp("families"), loaded_model.tokenizer.tok.to_str())
    yield models
    models.remove()

"""fleetllm's GGUF header reader gives what the ``gguf`` package's reader gives, in a fraction of the time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleetllm.models.gguf_file import read_gguf_file
from fleetllm.models.source import resolve


def test_metadata_and_tensors_equal_the_gguf_packages_reading() -> None:
    from gguf import GGUFReader

    path = resolve("smollm2-135m")
    ours, theirs = read_gguf_file(path), GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == expected.keys()
    for key, value in expected.items():  # the 49k-token vocabulary, merges and scores included
        assert type(ours.metadata[key]) is type(value) and ours.metadata[key] == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape, a.data.dtype, a.data.shape) == (b.tensor_type, tuple(map(int, b.shape)),
                                                                         b.data.dtype, b.data.shape), a.name
        assert np.array_equal(a.data, np.asarray(b.data)), a.name


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_file(bad)

"""HF transformers' own reading of the embedded model's GGUF, saved once per machine as a HF directory.

Loading SmolLM2 into transformers from its GGUF (converting the 49k-token vocabulary, dequantising and
renaming every tensor) costs ~17 s of CPU here (~45 s without the memoisation below); loading the
directory transformers saves afterwards takes a second or two. The weights are transformers' conversion, not fleetllm's, so the comparison stays
independent. The suite runs this file as a script from the session's start (niced, in the background:
tests/conftest.py) so the conversion overlaps other tests; the tests that compare against HF call
:func:`hf_reference_dir`, which waits for that run (a lock) or does the conversion itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import mmap
import os
import shutil
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

MODEL = "smollm2-135m"


def hf_reference_dir() -> Path:
    """The directory transformers saved after loading the GGUF; made first if no run has made it."""
    from importlib.metadata import version

    # neither torch nor transformers is imported to find the directory: where it exists (every run but a machine's
    # first), the session's preparation run of this file ends in a quarter of a second instead of ~3 s of imports
    from fleetllm.models.source import cache_dir, resolve

    gguf = Path(resolve(MODEL))
    target = cache_dir() / "hf-reference" / f"{gguf.stem}-transformers-{version('transformers')}"
    with cache_lock(target):
        if not (target / "done").exists():
            _convert(gguf, target)
    return target


@contextlib.contextmanager
def cache_lock(target: Path) -> Iterator[None]:
    """Held while one process builds ``target`` (others wait, then find it made)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers parses the GGUF with the ``gguf`` package three times (tokenizer, config, weights: 17 s of
    a ~45 s conversion) and builds the same tensor-name map hundreds of times (7 s): both are pure functions
    of their arguments, so they are memoised for the conversion. What transformers does with them is unchanged."""
    import gguf
    import gguf.gguf_reader

    saved = gguf.GGUFReader, gguf.get_tensor_name_map, gguf.gguf_reader.np
    gguf.GGUFReader = functools.cache(gguf.GGUFReader)
    gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)
    gguf.gguf_reader.np = _NumpyPlainMaps()
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, gguf.gguf_reader.np = saved


class _NumpyPlainMaps(types.ModuleType):
    """numpy as the ``gguf`` reader sees it, but mapping the file as a plain read-only array: the reader slices
    its map ~3.7 million times while parsing the 49k-token vocabulary, and each slice of an ``np.memmap`` makes a
    new memmap object (~3 s of the conversion); the bytes read are the same."""

    def __init__(self) -> None:
        super().__init__("numpy")

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def memmap(path: str | os.PathLike, mode: str = "r") -> Any:
        if mode != "r":
            return np.memmap(path, mode=mode)
        with open(path, "rb") as f:
            return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)


def _convert(gguf: Path, target: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_model

    with _gguf_parsed_once():
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                  dtype=torch.float32)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config.to_dict()  # save_pretrained refuses a model read from GGUF; its parts don't
    config.pop("quantization_config", None)  # the GGUF it came from, not how the saved weights are stored
    (tmp / "config.json").write_text(json.dumps(config))
    save_model(model, str(tmp / "model.safetensors"))
    tok.save_pretrained(tmp)
    (tmp / "done").touch()
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


if __name__ == "__main__":
    hf_reference_dir()

"""Which files of a repository the loader needs: config, tokenizer, chat template and weights, nothing else.

A repository often holds several copies of the same weights (safetensors, PyTorch .bin, ONNX, many GGUF
quantisations) and files no server reads (README, images). Only what ``fleetllm.models.loader`` reads is
fetched: the safetensors set (with its index) of a HF layout, or one GGUF file (named in the URI when the
repo holds several).
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatch

from fleetllm.store.errors import StoreError

# What TokenizerWrapper.from_hf_dir and ModelConfig.from_hf read (generation_config for eos ids).
METADATA = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
WEIGHTS = ("*.safetensors", "model.safetensors.index.json")
ADAPTER = ("adapter_config.json", "adapter_model.safetensors")  # a PEFT LoRA adapter: all a server reads of it


def needed_files(names: Iterable[str], model: str, file: str | None = None, weights: bool = True,
                 adapter: bool = False) -> list[str]:
    """The files to fetch out of a repository listing; ``weights=False`` for a tokenizer alone (the router);
    ``adapter=True`` for a PEFT LoRA adapter (:data:`ADAPTER`).

    Raises StoreError when the repo has no loadable weights, or several GGUF files and none was named.
    """
    names = sorted(names)
    if adapter:
        missing = [n for n in ADAPTER if n not in names]
        if missing:
            raise StoreError(f"adapter {model}: the repository has no {' or '.join(missing)} (a PEFT LoRA adapter "
                             f"holds {' and '.join(ADAPTER)})", 404)
        return list(ADAPTER)
    top = [n for n in names if "/" not in n]  # weights in subfolders (onnx/, original/) are other formats
    if file is not None:
        if file not in names:
            raise StoreError(f"model {model}: the repository has no file {file}", 404)
        return [file]
    meta = [n for n in top if n in METADATA]
    tensors = [n for n in top if any(fnmatch(n, p) for p in WEIGHTS)]
    if any(n.endswith(".safetensors") for n in tensors):
        return sorted(meta + tensors) if weights else meta
    ggufs = [n for n in top if n.endswith(".gguf")]
    if len(ggufs) == 1:
        return ggufs  # a GGUF holds its own config and tokenizer
    if ggufs:
        raise StoreError(f"model {model}: the repository holds {len(ggufs)} GGUF files; name one, e.g. "
                         f"{model.split('@')[0]}/{ggufs[0]}", 400)
    raise StoreError(f"model {model}: the repository has neither *.safetensors nor a .gguf file", 404)

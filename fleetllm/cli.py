"""The ``fleetllm`` command: ``worker`` (one engine behind the OpenAI API), ``generate`` and more."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them."""
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF directory (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-gb)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-waiting", type=int, default=1024, help="queue bound; beyond it requests get 503")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--quantization", default="none", choices=["none", "int4"],
                   help="int4: int4 decoder / int8 LM-head weights for decode steps on CPU (default: exact fp32)")
    p.add_argument("--speculative", default=None, metavar="method=M,k=N",
                   help="speculative decoding: method ngram | suffix | eagle | peagle, k draft tokens "
                        "(default k: chosen from the measured verify cost), adaptive=0 to fix K")


def engine_config(args: argparse.Namespace):  # -> EngineConfig (imported lazily: torch is slow to import)
    from fleetllm.engine.engine import EngineConfig

    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_gb=args.kv_cache_gb,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
        quantization=args.quantization,
        speculative=args.speculative,
    )


def cmd_worker(args: argparse.Namespace) -> int:
    # The HTTP thread shares the cores with torch's OpenMP pool; spinning OpenMP workers starve it and
    # stall every step that waits on a descheduled thread (batch-1 decode 13 -> 19 tok/s when passive).
    # Must be set before torch loads its OpenMP runtime.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import uvicorn

    from fleetllm.engine.engine import LLMEngine
    from fleetllm.server.app import Worker

    engine = LLMEngine(engine_config(args))
    logging.getLogger("fleetllm").info(
        "model %s loaded in %.1fs; %d KV blocks of %d tokens", engine.model_name, engine.loaded.load_seconds,
        engine.pool.num_blocks, engine.pool.block_size,
    )
    worker = Worker(engine)
    uvicorn.run(worker.app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from fleetllm.engine.llm import LLM
    from fleetllm.engine.sampling import SamplingParams

    cfg = engine_config(args)
    llm = LLM(**{k: v for k, v in vars(cfg).items()})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    res = llm.chat([{"role": "user", "content": args.prompt}], params)
    print(res.outputs[0].text)
    return 0


def cmd_spec_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fleetllm.spec.eagle import head_path
    from fleetllm.spec.train import train

    out = Path(args.output) if args.output else head_path(args.target, args.method)
    train(args.method, args.target, out, args.minutes, args.batch_size, args.lr, args.seed, args.text_tokens,
          args.chats, args.threads)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="serve one engine over the OpenAI-compatible API")
    add_engine_args(w)
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=8001)
    w.add_argument("--log-level", default="info")
    w.set_defaults(func=cmd_worker)

    g = sub.add_parser("generate", help="answer one chat prompt in-process (no server)")
    add_engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.set_defaults(func=cmd_generate)

    sp = sub.add_parser("spec", help="speculative decoding tools").add_subparsers(dest="spec_command", required=True)
    t = sp.add_parser("train", help="train an EAGLE / P-EAGLE draft head on the target's own outputs")
    t.add_argument("--method", choices=["eagle", "peagle"], required=True)
    t.add_argument("--target", default="smollm2-135m")
    t.add_argument("--output", default=None, help="default: the shipped head's path (fleetllm/spec/heads/)")
    t.add_argument("--minutes", type=float, default=10.0, help="training time budget (building the data not included)")
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--text-tokens", type=int, default=6000, help="stdlib source tokens to prefill")
    t.add_argument("--chats", type=int, default=48, help="chat answers to generate with the target")
    t.add_argument("--threads", type=int, default=2)
    t.set_defaults(func=cmd_spec_train)

    try:
        from fleetllm.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())

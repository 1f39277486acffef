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


def add_observability_args(p: argparse.ArgumentParser) -> None:
    """Worker identity (labels on every metric) and where telemetry goes."""
    p.add_argument("--worker-id", default=None, help="label `worker` on every metric (default: HOST:PORT)")
    p.add_argument("--role", default="both", choices=["both", "prefill", "decode"], help="label `role`")
    p.add_argument("--zone", default="local", help="label `zone`: where this worker runs (default: %(default)s)")
    p.add_argument("--instance-type", default=None, help="label `instance_type` (default: cpu, or the GPU's name)")
    p.add_argument("--otlp-endpoint", default=None,
                   help="OTLP/HTTP collector base URL (e.g. http://127.0.0.1:4318): metrics and request spans")
    p.add_argument("--otlp-interval", type=float, default=10.0, help="seconds between OTLP metric pushes")
    p.add_argument("--disable-metrics", action="store_true", help="record no engine metrics (overhead baseline)")
    p.add_argument("--disable-log-requests", action="store_true", help="no log line per request")


def worker_identity(args: argparse.Namespace) -> dict[str, str]:
    instance_type = args.instance_type
    if instance_type is None:
        import torch

        cuda = args.device in ("auto", "cuda") and torch.cuda.is_available()
        instance_type = torch.cuda.get_device_name(0) if cuda else "cpu"
    return {"worker": args.worker_id or f"{args.host}:{args.port}", "role": args.role, "zone": args.zone,
            "instance_type": instance_type}


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
        metric_labels=worker_identity(args) if hasattr(args, "zone") else {},
        disable_metrics=getattr(args, "disable_metrics", False),
    )


def cmd_worker(args: argparse.Namespace) -> int:
    # The HTTP thread shares the cores with torch's OpenMP pool; spinning OpenMP workers starve it and
    # stall every step that waits on a descheduled thread (batch-1 decode 13 -> 19 tok/s when passive).
    # Must be set before torch loads its OpenMP runtime.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import uvicorn
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # *_created series: half the /metrics page, read by nothing here

    from fleetllm.engine.engine import LLMEngine
    from fleetllm.server.app import ObservabilityConfig, Worker

    engine = LLMEngine(engine_config(args))
    logging.getLogger("fleetllm").info(
        "model %s loaded in %.1fs; %d KV blocks of %d tokens", engine.model_name, engine.loaded.load_seconds,
        engine.pool.num_blocks, engine.pool.block_size,
    )
    obs = ObservabilityConfig(args.otlp_endpoint, args.otlp_interval, not args.disable_log_requests)
    worker = Worker(engine, obs)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="serve one engine over the OpenAI-compatible API")
    add_engine_args(w)
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=8001)
    w.add_argument("--log-level", default="info")
    add_observability_args(w)
    w.set_defaults(func=cmd_worker)

    g = sub.add_parser("generate", help="answer one chat prompt in-process (no server)")
    add_engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.set_defaults(func=cmd_generate)

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

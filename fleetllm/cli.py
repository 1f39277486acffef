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


def add_observability_args(p: argparse.ArgumentParser) -> None:
    """Worker identity (labels on every metric) and where telemetry goes."""
    p.add_argument("--worker-id", default=None, help="label `worker` on every metric (default: HOST:PORT)")
    p.add_argument("--zone", default="local", help="label `zone`: where this worker runs (default: %(default)s)")
    p.add_argument("--instance-type", default=None, help="label `instance_type` (default: cpu, or the GPU's name)")
    p.add_argument("--otlp-endpoint", default=None,
                   help="OTLP/HTTP collector base URL (e.g. http://127.0.0.1:4318): metrics and request spans")
    p.add_argument("--otlp-interval", type=float, default=10.0, help="seconds between OTLP metric pushes")
    p.add_argument("--disable-metrics", action="store_true", help="record no engine metrics (overhead baseline)")
    p.add_argument("--disable-log-requests", action="store_true", help="no log line per request")


def worker_identity(args: argparse.Namespace, port: int | None = None) -> dict[str, str]:
    """The labels of a worker's metrics; ``port`` names a simulated worker among many in one process."""
    instance_type = args.instance_type
    if instance_type is None:
        instance_type = "cpu"
        if not getattr(args, "simulate", False) and args.device in ("auto", "cuda"):
            import torch

            if torch.cuda.is_available():
                instance_type = torch.cuda.get_device_name(0)
    worker = args.worker_id or f"{args.host}:{port or args.port}"
    if args.worker_id and port is not None and port != args.port:
        worker = f"{args.worker_id}-{port - args.port}"
    return {"worker": worker, "role": args.role, "zone": args.zone, "instance_type": instance_type}


def observability_config(args: argparse.Namespace):  # -> ObservabilityConfig
    from fleetllm.server.app import ObservabilityConfig

    return ObservabilityConfig(args.otlp_endpoint, args.otlp_interval, not args.disable_log_requests)


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
        metric_labels=worker_identity(args) if hasattr(args, "zone") else {},
        disable_metrics=getattr(args, "disable_metrics", False),
    )


def cmd_worker(args: argparse.Namespace) -> int:
    # The HTTP thread shares the cores with torch's OpenMP pool; spinning OpenMP workers starve it and
    # stall every step that waits on a descheduled thread (batch-1 decode 13 -> 19 tok/s when passive).
    # Must be set before torch loads its OpenMP runtime.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # *_created series: half the /metrics page, read by nothing here
    if args.simulate:
        return cmd_sim_worker(args)
    from fleetllm.engine.engine import LLMEngine
    from fleetllm.server.app import Worker
    from fleetllm.server.uvicorn_runner import run_app

    engine = LLMEngine(engine_config(args))
    logging.getLogger("fleetllm").info(
        "model %s loaded in %.1fs; %d KV blocks of %d tokens", engine.model_name, engine.loaded.load_seconds,
        engine.pool.num_blocks, engine.pool.block_size,
    )
    worker = Worker(engine, observability_config(args), role=args.role)
    run_app(worker.app, args.host, args.port, args.log_level, on_exit=lambda: setattr(worker, "closing", True))
    return 0


def cmd_sim_worker(args: argparse.Namespace) -> int:
    from fleetllm.sim.engine import SimConfig
    from fleetllm.sim.profile import TimingProfile
    from fleetllm.sim.server import serve_simulated

    profile = TimingProfile.load(args.profile) if args.profile else TimingProfile.default()
    cfg = SimConfig(model_name=args.served_model_name or args.model, max_model_len=args.max_model_len or 8192,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    max_waiting=args.max_waiting, num_blocks=args.num_blocks, block_size=args.block_size,
                    enable_prefix_caching=not args.no_prefix_caching, speed=args.sim_speed)
    logging.getLogger("fleetllm").info("%d simulated worker(s) on %s:%d-%d", args.count, args.host, args.port,
                                       args.port + args.count - 1)
    identities = [worker_identity(args, args.port + i) for i in range(args.count)]
    serve_simulated(args.model, args.host, args.port, args.count, cfg, profile, args.log_level,
                    identities=identities, obs=observability_config(args))
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


def add_router_args(p: argparse.ArgumentParser) -> None:
    """Router flags shared by ``fleetllm router`` and ``fleetllm serve``."""
    from fleetllm.router.policies import POLICY_NAMES

    p.add_argument("--policy", default="kv_aware", choices=POLICY_NAMES, help="routing policy (default: %(default)s)")
    p.add_argument("--max-retries", type=int, default=2, help="retries on other workers before the first byte")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    p.add_argument("--breaker-threshold", type=int, default=3, help="consecutive failures that open a worker's breaker")
    p.add_argument("--breaker-cooldown", type=float, default=5.0, help="seconds a breaker stays open before a probe")
    p.add_argument("--session-header", default="x-session-id", help="header naming a session (else the body's `user`)")
    p.add_argument("--profile", default=None, help="calibration profile (fleetllm calibrate) for the cost model")
    p.add_argument("--seed", type=int, default=None, help="seed for random tie-breaks")
    p.add_argument("--pd-threshold", type=int, default=4096,
                   help="disaggregate when the decode worker lacks at least this many prompt tokens")
    p.add_argument("--pd-timeout", type=float, default=120.0, help="seconds for a remote prefill + KV transfer")


def router_config(args: argparse.Namespace, workers: list[str], zones: list[str] | None = None,
                  roles: list[str] | None = None):  # -> RouterConfig
    from fleetllm.router.gateway import RouterConfig
    from fleetllm.sim.profile import TimingProfile

    # Rates of the shipped SmolLM2-on-CPU profile unless a measured one is given (fleetllm calibrate).
    cost = (TimingProfile.load(args.profile) if args.profile else TimingProfile.default()).cost_model()
    tokenizers = dict(kv.split("=", 1) for kv in getattr(args, "tokenizer", None) or [])
    return RouterConfig(workers=workers, policy=args.policy, zones=zones or [], max_retries=args.max_retries,
                        health_interval_s=args.health_interval, session_header=args.session_header,
                        breaker_threshold=args.breaker_threshold, breaker_cooldown_s=args.breaker_cooldown,
                        tokenizers=tokenizers, cost=cost, seed=args.seed, roles=roles or [],
                        pd_threshold=args.pd_threshold, pd_timeout_s=args.pd_timeout)


def cmd_router(args: argparse.Namespace) -> int:
    from fleetllm.router.gateway import Router
    from fleetllm.server.uvicorn_runner import run_app

    workers = [u for u in args.workers.split(",") if u]
    zones = args.zones.split(",") if args.zones else None
    roles = args.roles.split(",") if args.roles else None
    router = Router(router_config(args, workers, zones, roles))
    logging.getLogger("fleetllm").info("router on %s:%d over %d workers, policy %s", args.host, args.port,
                                       len(workers), args.policy)
    pusher = None
    if args.otlp_endpoint:  # the router's own series; each worker pushes its own
        from fleetllm.observability.otlp import OTLPMetricsPusher, resource_for

        pusher = OTLPMetricsPusher(router.metrics.registry, args.otlp_endpoint,
                                   resource_for("fleetllm-router", {"router": f"{args.host}:{args.port}"}), args.otlp_interval)
        pusher.start()
    try:
        run_app(router.app, args.host, args.port, args.log_level, on_exit=lambda: setattr(router, "closing", True))
    finally:
        if pusher:
            pusher.stop()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from fleetllm.fleet.config import FleetConfig
    from fleetllm.fleet.launcher import run_fleet

    if args.config:
        cfg = FleetConfig.from_yaml(args.config)
    else:
        cfg = FleetConfig.single_model(args.model, args.replicas, args.simulate, args.prefill, args.decode,
                                       args.num_threads, args.speculative)
    if args.pd_threshold is not None:
        cfg.pd_threshold = args.pd_threshold
    cfg.host, cfg.port = args.host or cfg.host, args.port or cfg.port
    cfg.policy = args.policy or cfg.policy
    cfg.restart = cfg.restart or args.restart
    if args.log_dir:
        cfg.log_dir = args.log_dir
    cfg.otlp_endpoint = args.otlp_endpoint or cfg.otlp_endpoint
    return run_fleet(cfg)


def cmd_calibrate(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from fleetllm.sim.calibrate import calibrate

    prof = calibrate(args.model, threads=args.num_threads, repeats=args.repeats)
    prof.save(args.output)
    print(f"wrote {args.output}: prefill {prof.prefill}, decode {prof.decode}, "
          f"context {prof.ctx_s_per_token * 1e6:.2f} us/token/seq")
    return 0


def cmd_spec_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fleetllm.speculative.eagle import head_path
    from fleetllm.speculative.train import train

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
    w.add_argument("--role", default="both", choices=["prefill", "decode", "both"],
                   help="disaggregated serving: prefill workers get only remote prefills from the router; "
                        "also the `role` label on the worker's metrics")
    add_observability_args(w)
    w.add_argument("--simulate", action="store_true", help="timing-model worker (no weights): for fleet experiments")
    w.add_argument("--profile", default=None, help="--simulate: timing profile from fleetllm calibrate")
    w.add_argument("--count", type=int, default=1, help="--simulate: workers on consecutive ports in one process")
    w.add_argument("--sim-speed", type=float, default=1.0, help="--simulate: run the timing model this much faster")
    w.set_defaults(func=cmd_worker)

    r = sub.add_parser("router", help="OpenAI-compatible gateway routing over many workers")
    r.add_argument("--workers", required=True, help="comma-separated worker base URLs")
    r.add_argument("--zones", default=None, help="comma-separated zone per worker (metrics label)")
    r.add_argument("--roles", default=None, help="comma-separated role per worker (prefill|decode|both); "
                   "workers also report their role themselves")
    r.add_argument("--tokenizer", action="append", metavar="MODEL=REF",
                   help="tokenizer for a served model name that is not itself a model reference")
    add_router_args(r)
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--log-level", default="info")
    r.add_argument("--otlp-endpoint", default=None, help="OTLP/HTTP collector base URL for the router's metrics")
    r.add_argument("--otlp-interval", type=float, default=10.0, help="seconds between OTLP metric pushes")
    r.set_defaults(func=cmd_router)

    s = sub.add_parser("serve", help="start N workers and a router on this machine (a fleet)")
    s.add_argument("--config", default=None, help="fleet YAML (see fleetllm/fleet/config.py); flags override it")
    s.add_argument("--replicas", type=int, default=2)
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--simulate", action="store_true", help="simulated workers (timing model, no weights)")
    s.add_argument("--prefill", type=int, default=0, help="disaggregated fleet: prefill-role workers")
    s.add_argument("--decode", type=int, default=0, help="disaggregated fleet: decode-role workers")
    s.add_argument("--pd-threshold", type=int, default=None, help="uncached prompt tokens that make a request "
                   "prefill remotely (default 4096)")
    s.add_argument("--num-threads", type=int, default=None, help="torch threads per worker (default: cores / replicas)")
    s.add_argument("--policy", default=None, help="routing policy (default: kv_aware)")
    s.add_argument("--restart", action="store_true", help="restart worker processes that die")
    s.add_argument("--log-dir", default=None, help="where worker and router logs go (default: a temp dir)")
    s.add_argument("--host", default=None, help="default 127.0.0.1")
    s.add_argument("--port", type=int, default=None, help="router port (default 8000); workers use the next ones")
    s.add_argument("--otlp-endpoint", default=None, help="OTLP/HTTP collector for the router and every worker")
    s.add_argument("--speculative", default=None, metavar="method=M,k=N",
                   help="speculative decoding on every real worker (see `fleetllm worker --speculative`)")
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("calibrate", help="measure the engine's step times for the simulated worker's timing model")
    c.add_argument("--model", default="smollm2-135m")
    c.add_argument("--num-threads", type=int, default=1)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--output", required=True)
    c.set_defaults(func=cmd_calibrate)

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
    t.add_argument("--output", default=None, help="default: the shipped head's path (fleetllm/speculative/heads/)")
    t.add_argument("--minutes", type=float, default=10.0, help="training time budget (building the data not included)")
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--text-tokens", type=int, default=24000, help="stdlib source tokens to prefill")
    t.add_argument("--chats", type=int, default=384, help="answers to generate with the target (chat, code, tool copying)")
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
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())

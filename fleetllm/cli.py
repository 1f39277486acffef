"""The ``fleetllm`` command: ``worker`` (one engine behind the OpenAI API), ``router``, ``serve`` and more.

The flags are generated from config dataclasses (:mod:`fleetllm.cli_options`): the components' own
(EngineConfig, RouterConfig, ObservabilityConfig, SimConfig) and, below, the few that configure no
component (where a server listens, a worker's labels, ``serve``'s fleet shape).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import json
import logging
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NoReturn

from fleetllm.capture.config import CaptureConfig
from fleetllm.cli_options import add_options, cli_fields, flag_name, from_args, opt
from fleetllm.disagg.config import TransferOptions
from fleetllm.engine.config import EngineConfig
from fleetllm.errors import UsageError, did_you_mean, existing_file, one_line
from fleetllm.fleet.runfile import RunDirOption
from fleetllm.kvtier.remote import no_auto
from fleetllm.lora.options import LoraServingOptions
from fleetllm.router.config import RouterConfig
from fleetllm.router.state_url import fleet_state_url_value
from fleetllm.server.body_limit import DEFAULT_MAX_BODY_BYTES
from fleetllm.server.config import KVEventsOptions, ObservabilityConfig
from fleetllm.server.header_timeout import DEFAULT_HEADER_TIMEOUT_S
from fleetllm.server.pinning import PinningOptions, pin_process
from fleetllm.server.worker_secret import warn_if_open, worker_secret
from fleetllm.sim.config import SimConfig
from fleetllm.store.config import StoreConfig
from fleetllm.store.errors import StoreError
from fleetllm.tools.config import ToolConfig

if TYPE_CHECKING:
    from fleetllm.fleet.config import FleetConfig
    from fleetllm.server.uvicorn_runner import TLSFiles


@dataclass
class ListenOptions:
    """Where a server listens."""

    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on")
    log_level: str = opt("info", "uvicorn log level")
    max_body_bytes: int = opt(DEFAULT_MAX_BODY_BYTES, "largest request body accepted (413 above)")
    header_timeout_s: float = opt(DEFAULT_HEADER_TIMEOUT_S, "seconds a client has to send a request's headers "
                                                            "(then 408 and the connection is closed: slow-loris)")
    tls_certfile: str | None = opt(None, "serve HTTPS with this certificate chain (PEM; with --tls-keyfile)")
    tls_keyfile: str | None = opt(None, "the private key of --tls-certfile (PEM)")


def tls_files(args: argparse.Namespace) -> TLSFiles | None:
    """The server's certificate and key when both are given (HTTPS); one without the other is an error."""
    from fleetllm.server.uvicorn_runner import TLSFiles

    if bool(args.tls_certfile) != bool(args.tls_keyfile):
        given, other = ("--tls-certfile", "--tls-keyfile") if args.tls_certfile else ("--tls-keyfile", "--tls-certfile")
        raise UsageError(f"{given} needs {other} too (a certificate chain and its private key, both PEM)")
    for path in filter(None, (args.tls_certfile, args.tls_keyfile)):
        existing_file(path, "TLS file")
    return TLSFiles(args.tls_certfile, args.tls_keyfile) if args.tls_certfile else None


@dataclass
class WorkerOptions:
    """A worker's role in a fleet and its identity: the labels on every metric."""

    role: Literal["prefill", "decode", "both"] = opt(
        "both", "disaggregated serving: prefill workers get only remote prefills from the router; also the "
                "`role` label on the worker's metrics")
    worker_id: str | None = opt(None, "label `worker` on every metric (default: HOST:PORT)")
    zone: str = opt("local", "label `zone`: where this worker runs")
    instance_type: str | None = opt(None, "label `instance_type` (default: cpu, or the GPU's name)")
    drain_timeout_s: float = opt(30.0, "on SIGTERM: seconds to let in-flight requests finish (/ready answers "
                                       "503 draining meanwhile) before exiting")
    api_key: str | None = opt(None, "clients must send `Authorization: Bearer KEY` (probes excepted); a fleet's "
                                    "workers take their fleet's secret (FLEETLLM_WORKER_SECRET) instead; with "
                                    "neither, the worker serves anyone")


@dataclass
class SimulateOptions:
    """``fleetllm worker --simulate``: timing-model workers, many in one process."""

    simulate: bool = opt(False, "timing-model worker (no weights): for fleet experiments")
    count: int = opt(1, "--simulate: workers on consecutive ports in one process")


@dataclass
class ProfileOption:
    """The calibrated timing profile that the simulated worker runs and the router's cost model reads."""

    profile: str | None = opt(None, "timing profile from `fleetllm calibrate` (default: the shipped "
                                    "SmolLM2-on-CPU one): the simulated worker's step times, the router's "
                                    "cost model")


@dataclass
class ServeOptions:
    """``fleetllm serve``: a fleet from a YAML file or from these flags (which override the file)."""

    config: str | None = opt(None, "fleet YAML (see fleetllm/fleet/config.py); flags override it")
    replicas: int = opt(2, "workers, all of one model")
    simulate: bool = opt(False, "simulated workers (timing model, no weights)")
    prefill: int = opt(0, "disaggregated fleet: prefill-role workers")
    decode: int = opt(0, "disaggregated fleet: decode-role workers")
    num_threads: int | None = opt(None, "torch threads per worker (default: cores / replicas)")
    cores_per_worker: int | None = opt(None, "reserve this many cores for each worker and pin it to them "
                                             "(fleetllm worker --cpus); default: the workers share the cores")
    restart: bool = opt(True, "restart worker processes that die")
    log_dir: str | None = opt(None, "where worker and router logs go (default: a temp dir)")
    admin_token_file: str | None = opt(None, "the router's admin token (Authorization: Bearer, for /admin/* and "
                                             "/router/state): read from this file, else minted into it (mode "
                                             "0600); default: admin-token in the log directory")
    host: str | None = opt(None, "router address (default: the config's, else 127.0.0.1)")
    port: int | None = opt(None, "router port (default: the config's, else 8000); workers use the next ones")
    ray: str | None = opt(None, "run every copy as an actor on this Ray cluster (auto or HOST:PORT); the "
                                "config's `ray:` block gives the rest")
    state_url: str | None = opt(None, "the router's shared state (fleetllm router --state-url), or auto: a private "
                                      "redis-server on a free 127.0.0.1 port, stopped with the fleet (overrides the "
                                      "config's state_url)", parse=fleet_state_url_value, metavar="URL|auto")


def load_profile(args: argparse.Namespace):  # -> TimingProfile
    from fleetllm.sim.profile import TimingProfile

    return TimingProfile.load(existing_file(args.profile, "--profile timing profile")) if args.profile \
        else TimingProfile.default()


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


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine a ``fleetllm worker`` command line describes (with its identity as metric labels)."""
    return from_args(EngineConfig, args, metric_labels=worker_identity(args), store=from_args(StoreConfig, args),
                     kv_pool_shared=from_args(TransferOptions, args).shares_pool(args.role))


def observability_config(args: argparse.Namespace) -> ObservabilityConfig:
    return from_args(ObservabilityConfig, args)


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The router a ``fleetllm router`` command line describes (cost rates from --profile)."""
    cost = load_profile(args).cost_model().with_tier_load(getattr(args, "kv_tier_load", None) or {})
    lora = getattr(args, "lora_load_cost_s", None)
    if lora is not None and not lora >= 0:
        raise UsageError(f"--lora-load-cost {lora}: give 0 or more seconds")
    cfg = from_args(RouterConfig, args, cost=cost if lora is None else replace(cost, lora_load_s=lora))
    cfg.check()
    return cfg


def capture_for(args: argparse.Namespace, component: str, tiers: tuple[str, ...], registry):  # -> Capture | None
    """The process's capture from its ``--capture-*`` flags (None when no destination is given)."""
    cfg = from_args(CaptureConfig, args)
    if not cfg.enabled:
        return None
    from fleetllm.capture.recorder import Capture

    return Capture(cfg, component, tiers, registry)


def cmd_worker(args: argparse.Namespace) -> int:
    # OpenMP's wait policy stays libgomp's default (a parked thread spins ~3 ms, then sleeps): PASSIVE made every
    # parallel region wake its threads through the kernel (Q4 batch-1 decode 30 -> 52 tok/s without it), ACTIVE
    # starves the HTTP thread at c=8. The spin only holds with one OpenMP team in the process: see omp_team.
    check_worker_args(args)
    if args.cpus:  # before torch starts its thread pool, which then fits the pinned cores
        try:
            cpus = pin_process(args.cpus)
        except ValueError as e:
            raise UsageError(f"--cpus {args.cpus}: {e}") from None
        args.num_threads = args.num_threads or len(cpus)
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # *_created series: half the /metrics page, read by nothing here
    if args.simulate:
        return cmd_sim_worker(args)
    from fleetllm.store import prefetch

    # The hub client's HTTP core imports trio when it is installed only to tell trio from asyncio; a worker
    # runs asyncio alone, and that import (a third of the client's) holds the GIL that torch's import needs.
    sys.modules.setdefault("trio", None)  # type: ignore[arg-type]  # ``import trio`` raises ImportError
    # Imports and the model load make ~200k long-lived objects; the collector's passes over them were 12% of
    # the imports' time. Off until the engine is up, then those objects are frozen out of every later pass.
    gc.disable()
    prefetch.start(args.model, from_args(StoreConfig, args))  # the store's part of a cold start overlaps the imports
    from fleetllm.engine.engine import LLMEngine
    from fleetllm.engine.omp_team import run_on_passing_thread
    from fleetllm.kernels.health import KernelsMissing
    from fleetllm.models.config import UnsupportedModel
    from fleetllm.server.app import Worker
    from fleetllm.server.uvicorn_runner import make_server

    try:
        engine = run_on_passing_thread(lambda: LLMEngine(engine_config(args)))  # its OpenMP pool ends with it
    except (StoreError, UnsupportedModel, KernelsMissing) as e:  # no access, no such model, source down without a
        # cached copy, an architecture fleetllm does not run, FLEETLLM_REQUIRE_KERNELS=1 without a kernel: one line,
        # exit 2
        raise UsageError(f"cannot start: {e}") from None
    gc.freeze()
    gc.enable()
    logging.getLogger("fleetllm").info(
        "model %s loaded in %.1fs; %d KV blocks of %d tokens", engine.model_name, engine.loaded.load_seconds,
        engine.pool.num_blocks, engine.pool.block_size,
    )
    capture = capture_for(args, "worker-" + worker_identity(args)["worker"], ("worker",), engine.metrics.registry)
    with lora_modules_refused():
        worker = Worker(engine, observability_config(args), role=args.role, capture=capture,
                        max_body_bytes=args.max_body_bytes, tools=from_args(ToolConfig, args),
                        kv_events=from_args(KVEventsOptions, args), transfer=from_args(TransferOptions, args),
                        api_key=args.api_key, lora=from_args(LoraServingOptions, args),
                        store=from_args(StoreConfig, args))
    warn_if_open(args.host, worker.secret, args.api_key)
    server = make_server(worker.app, args.host, args.port, args.log_level,
                         on_exit=lambda: setattr(worker, "closing", True),
                         drain=lambda: worker.drain(args.drain_timeout_s), header_timeout_s=args.header_timeout_s,
                         tls=tls_files(args))
    worker.on_fatal = server.exit_now
    server.run()
    return 1 if worker.async_engine.failure else 0  # non-zero: the supervisor restarts this worker


def check_worker_args(args: argparse.Namespace) -> None:
    """Refuse, before anything loads, what a worker cannot start with (UsageError, one line)."""
    from fleetllm.models.source import check_ref

    check_ref(args.model)
    check_engine_args(args)
    tls_files(args)
    check_json_flag("--kv-events-config", args.kv_events_config)
    check_lora_args(args)
    if args.count < 1:
        raise UsageError(f"--count {args.count}: a simulated worker count is 1 or more")


def check_lora_args(args: argparse.Namespace) -> None:
    """``--lora-modules`` and ``--allowed-local-lora-paths`` refused before the model loads when malformed, naming a
    local directory that does not exist, or given without LoRA on (UsageError, one line)."""
    from fleetllm.lora.modules import parse_modules
    from fleetllm.store.uri import is_remote

    modules = parse_modules(args.lora_modules, args.served_model_name or args.model)
    for m in modules:
        if not is_remote(m.path) and not Path(m.path).expanduser().is_dir():
            raise UsageError(f"--lora-modules {m.name}={m.path}: no such directory")
    for root in args.allowed_local_lora_paths:
        if not Path(root).expanduser().is_dir():
            raise UsageError(f"--allowed-local-lora-paths {root}: no such directory")
    if modules and not args.enable_lora:
        raise UsageError("--lora-modules needs --enable-lora (LoRA is off without it)")
    for flag, value in (("--max-loras", args.max_loras), ("--max-lora-rank", args.max_lora_rank)):
        if value < 1:
            raise UsageError(f"{flag} {value}: give 1 or more")
    if args.max_cpu_loras is not None and args.max_cpu_loras < 0:
        raise UsageError(f"--max-cpu-loras {args.max_cpu_loras}: give 0 or more")


# Engine flags that count something: 0 or less is a typo, which the engine would only find after the model loads.
POSITIVE_ENGINE_FLAGS = ("block_size", "num_blocks", "kv_cache_gb", "max_model_len", "max_num_seqs",
                         "max_num_batched_tokens", "num_threads")
# Engine flags whose 0 means something (no ageing, no rows beside an urgent first token): below 0 is a typo.
NON_NEGATIVE_ENGINE_FLAGS = ("priority_aging_s", "urgent_step_rows")


TIER_FLAGS = ("kv_offload_gb", "kv_offload_dtype", "kv_disk_dir", "kv_disk_gb", "kv_remote")  # serve passes them to every real worker


def check_offload(args: argparse.Namespace) -> None:
    """The tiers' sizes are GiB: ``--kv-offload-gb`` 0 (no host tier) or more, ``--kv-disk-gb`` more than 0
    (UsageError)."""
    value = getattr(args, "kv_offload_gb", None)
    if value is not None and value < 0:
        raise UsageError(f"--kv-offload-gb {value}: give 0 (no host tier) or more GiB")
    disk = getattr(args, "kv_disk_gb", None)
    if disk is not None and disk <= 0:
        raise UsageError(f"--kv-disk-gb {disk}: give a positive number of GiB (or leave out --kv-disk-dir)")


def _host_tier(cfg, args: argparse.Namespace) -> None:  # cfg: FleetConfig
    """``serve --kv-offload-gb``, ``--kv-disk-dir``, ``--kv-disk-gb``, ``--kv-remote``: every real worker's (over
    the YAML's engine settings); a simulated worker holds no KV tensors to keep. Workers on one machine share
    the disk folder (one node's blocks)."""
    check_offload(args)
    for name in TIER_FLAGS:
        value = getattr(args, name, None)
        for m in cfg.models if value is not None else ():
            if not m.simulate:
                m.engine[name] = value


def check_engine_args(args: argparse.Namespace) -> None:
    """The engine flags' values that no engine takes, refused before the model loads (UsageError)."""
    from fleetllm.speculative.config import SpeculativeConfig

    for name in POSITIVE_ENGINE_FLAGS:
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {value}: give a positive number (or leave it out)")
    for f in (f for f in cli_fields(EngineConfig) if f.name in NON_NEGATIVE_ENGINE_FLAGS):
        value = getattr(args, f.name, None)
        if value is not None and value < 0:
            raise UsageError(f"{flag_name(f)} {value}: give 0 or more")
    check_offload(args)
    try:
        no_auto(getattr(args, "kv_remote", None))
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        SpeculativeConfig.parse(args.speculative)
    except ValueError as e:
        raise UsageError(f"--speculative {args.speculative}: {e} (e.g. method=suffix,k=4)") from None


def check_json_flag(flag: str, text: str | None) -> None:
    """A flag whose value is a JSON object (vLLM's --kv-events-config), refused unless it is one."""
    if text is None:
        return
    try:
        ok = isinstance(json.loads(text), dict)
    except ValueError:
        ok = False
    if not ok:
        raise UsageError(f"{flag} {text!r}: a JSON object, e.g. '{{\"endpoint\": \"tcp://*:5557\"}}'")


def writable_dir(path: str, flag: str) -> None:
    """``path``'s directory exists (created if need be) before a long run that writes there at its end."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create it ({e.strerror})") from None


def cmd_sim_worker(args: argparse.Namespace) -> int:
    from fleetllm.sim.server import serve_simulated

    cfg = sim_config(args)
    logging.getLogger("fleetllm").info("%d simulated worker(s) on %s:%d-%d", args.count, args.host, args.port,
                                       args.port + args.count - 1)
    identities = [worker_identity(args, args.port + i) for i in range(args.count)]
    extra = {}
    if args.destination:  # capture: one per simulated worker (passed only when on)
        extra["captures"] = lambda i, e: capture_for(args, "worker-" + identities[i]["worker"], ("worker",),
                                                     e.metrics.registry)
    if args.kv_events_config:  # vLLM-format KV events: one publisher per simulated worker, ports counted up
        extra["kv_events"] = from_args(KVEventsOptions, args)
    warn_if_open(args.host, worker_secret(), args.api_key)
    with lora_modules_refused():
        failed = serve_simulated(args.model, args.host, args.port, args.count, cfg, load_profile(args),
                                 args.log_level, identities=identities, obs=observability_config(args),
                                 drain_timeout_s=args.drain_timeout_s, header_timeout_s=args.header_timeout_s,
                                 store=from_args(StoreConfig, args), tls=tls_files(args), api_key=args.api_key,
                                 lora=from_args(LoraServingOptions, args), **extra)
    return 1 if failed else 0


@contextlib.contextmanager
def lora_modules_refused() -> Iterator[None]:
    """A ``--lora-modules`` adapter the worker cannot load as it starts (it does not fit, its source refuses): one
    line and exit 2, as any other bad flag."""
    from fleetllm.server.errors import APIError

    try:
        yield
    except APIError as e:
        raise UsageError(f"--lora-modules: {e.message}") from None


def sim_config(args: argparse.Namespace) -> SimConfig:
    """The simulated engine's settings from the worker's flags (the engine's, by name, and --sim-speed)."""
    # The simulator's own default where the engine's is "from the model" (which it has no weights of).
    return from_args(SimConfig, args, model_name=args.served_model_name or args.model,
                     max_model_len=args.max_model_len or SimConfig.max_model_len)


def cmd_generate(args: argparse.Namespace) -> int:
    from fleetllm.models.source import check_ref

    check_ref(args.model)
    check_engine_args(args)
    if args.max_tokens < 1 or args.temperature < 0:
        raise UsageError("--max-tokens is 1 or more and --temperature 0 (greedy) or more")
    from fleetllm.engine.llm import LLM
    from fleetllm.engine.sampling import SamplingParams
    from fleetllm.models.config import UnsupportedModel

    try:
        llm = LLM(**vars(from_args(EngineConfig, args, store=from_args(StoreConfig, args))))
    except UnsupportedModel as e:  # an architecture fleetllm does not run: one line, exit 2
        raise UsageError(f"cannot start: {e}") from None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    res = llm.chat([{"role": "user", "content": args.prompt}], params)
    print(res.outputs[0].text)
    return 0


def build_router(args: argparse.Namespace):  # -> Router
    """The router a ``fleetllm router`` command line describes, with its discovery source if any."""
    from fleetllm.router.gateway import Router

    # Rates of the shipped SmolLM2-on-CPU profile unless a measured one is given (fleetllm calibrate).
    router = Router(router_config(args), max_body_bytes=args.max_body_bytes)
    if args.discover == "kubernetes":
        from fleetllm.router.discovery.kubernetes import KubernetesDiscovery, KubernetesDiscoveryConfig

        try:
            router.background.append(KubernetesDiscovery(from_args(KubernetesDiscoveryConfig, args)).run)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return router


def check_router_args(args: argparse.Namespace) -> None:
    """Refuse, before the router starts, worker specs and traffic splits it cannot read (UsageError)."""
    from fleetllm.router.backends import parse_worker
    from fleetllm.router.traffic import parse_weights

    for spec in args.workers:
        try:
            parse_worker(spec)
        except ValueError as e:
            raise UsageError(f"--workers: {e}") from None
    for model, split in args.traffic.items():
        try:
            parse_weights(split)
        except ValueError as e:
            raise UsageError(f"--traffic {model}={split}: {e}") from None
    check_json_flag("--kv-events-config", args.kv_events_config)


def admin_token_file(args: argparse.Namespace) -> str | None:
    """``--admin-token-file``: read, or minted (into a new private directory when not given); its path
    printed for the operator, and set on ``args`` for the router to read. Returns that new directory (the
    token lives as long as the router: the caller removes it), else None."""
    from fleetllm.router.admin_token import load_or_mint

    given = args.admin_token_file
    try:
        _, path = load_or_mint(given)
    except (OSError, ValueError) as e:
        raise UsageError(f"--admin-token-file {args.admin_token_file}: {one_line(e)}") from None
    args.admin_token_file = str(path)
    print(f"admin token file: {path}", flush=True)
    return None if given else str(path.parent)


def cmd_router(args: argparse.Namespace) -> int:
    from fleetllm.server.uvicorn_runner import run_app

    check_router_args(args)
    tls = tls_files(args)  # before anything starts: a missing half is the user's to fix
    minted_dir = admin_token_file(args)
    try:
        router = build_router(args)
    except BaseException:  # a mistake found while building it (a profile, discovery settings): no token left behind
        if minted_dir:
            shutil.rmtree(minted_dir, ignore_errors=True)
        raise
    router.capture = capture_for(args, "router", ("endpoint", "access"), router.metrics.registry)
    logging.getLogger("fleetllm").info("router on %s:%d over %d workers, policy %s", args.host, args.port,
                                       len(args.workers), args.policy)
    pusher = None
    if args.otlp_endpoint:  # the router's own series; each worker pushes its own
        from fleetllm.observability.otlp import OTLPMetricsPusher, resource_for

        pusher = OTLPMetricsPusher(router.metrics.registry, args.otlp_endpoint,
                                   resource_for("fleetllm-router", {"router": f"{args.host}:{args.port}"}), args.otlp_interval_s)
        pusher.start()

    def on_exit() -> None:  # when shutdown starts (uvicorn ends a SIGTERM'd process by re-raising the signal)
        router.closing = True
        if minted_dir:  # the token was this process's alone; it holds it in memory from start-up
            shutil.rmtree(minted_dir, ignore_errors=True)

    try:
        run_app(router.app, args.host, args.port, args.log_level, on_exit=on_exit,
                header_timeout_s=args.header_timeout_s, tls=tls)
    finally:
        if pusher:
            pusher.stop()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from fleetllm.fleet.launcher import run_fleet
    from fleetllm.fleet.runfile import state_path

    cfg = fleet_config(args)
    if cfg.ray is None:  # copies start here: each source must name a model here (a Ray node may have its own)
        check_sources(cfg, args.config)
    return run_fleet(cfg, state_path(cfg.port, args.run_dir))


def check_sources(cfg: FleetConfig, config: str | None) -> None:
    """Every model's ``source`` names a model on this machine, or is a store URI (UsageError naming the entry)."""
    from fleetllm.models.source import check_ref

    for i, m in enumerate(cfg.models):
        try:
            check_ref(m.source)
        except UsageError as e:
            raise UsageError(f"{config}: models[{i}].source: {e}" if config else str(e)) from None


def fleet_config(args: argparse.Namespace):  # -> FleetConfig
    """The fleet a ``fleetllm serve`` command line describes: its YAML, with the flags given overriding it."""
    from fleetllm.fleet.config import FleetConfig

    check_serve_args(args)
    if args.config:
        cfg = FleetConfig.from_yaml(args.config)
    else:
        cfg = FleetConfig.single_model(args.model, args.replicas, args.simulate, args.prefill, args.decode,
                                       args.num_threads, args.speculative, args.cores_per_worker)
    if args.pd_threshold is not None:
        cfg.pd_threshold = args.pd_threshold
    _host_tier(cfg, args)
    cfg.host, cfg.port = args.host or cfg.host, args.port or cfg.port
    cfg.policy = args.policy or cfg.policy
    cfg.keys_file = args.keys_file or cfg.keys_file
    if args.scheduling_policy:
        for m in cfg.models:
            m.engine["scheduling_policy"] = args.scheduling_policy
    cfg.state_url = args.state_url or cfg.state_url
    cfg.restart = cfg.restart and args.restart  # on unless the YAML or --no-restart turns it off
    if args.log_dir:
        cfg.log_dir = args.log_dir
    cfg.admin_token_file = args.admin_token_file or cfg.admin_token_file
    cfg.otlp_endpoint = args.otlp_endpoint or cfg.otlp_endpoint
    if args.ray:
        from fleetllm.fleet.config import RaySettings

        cfg.ray = RaySettings(**{**vars(cfg.ray or RaySettings()), "address": args.ray})
    given = {f.name: getattr(args, f.name) for f in cli_fields(CaptureConfig) if getattr(args, f.name) is not None}
    cfg.capture = CaptureConfig(**{**vars(cfg.capture), **given})
    return cfg


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse flags that contradict each other or a fleet with nothing to run (UsageError, one line)."""
    shape = [flag for flag, given in (("--simulate", args.simulate), ("--prefill", args.prefill),
                                      ("--decode", args.decode), ("--num-threads", args.num_threads),
                                      ("--cores-per-worker", args.cores_per_worker)) if given]
    if args.config and shape:
        raise UsageError(f"{', '.join(shape)}: flags that describe a fleet without a config, but --config "
                         f"{args.config} gives its models: set them in the YAML instead")
    if bool(args.prefill) != bool(args.decode):
        raise UsageError("a disaggregated fleet needs both roles: give --prefill N and --decode M (or neither)")
    if min(args.replicas, args.prefill, args.decode) < 0:
        raise UsageError("--replicas, --prefill and --decode count workers: 0 or more")
    if not (args.config or args.replicas or args.prefill):
        raise UsageError("--replicas 0: a fleet runs 1 or more workers")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from fleetllm.models.source import check_ref

    check_ref(args.model)
    writable_dir(str(Path(args.output).parent), "--output")
    from fleetllm.sim.calibrate import calibrate

    prof = calibrate(args.model, threads=args.num_threads, repeats=args.repeats)
    prof.save(args.output)
    print(f"wrote {args.output}: prefill {prof.prefill}, decode {prof.decode}, "
          f"context {prof.ctx_s_per_token * 1e6:.2f} us/token/seq")
    return 0


def cmd_spec_train(args: argparse.Namespace) -> int:
    from fleetllm.models.source import check_ref

    check_ref(args.target)
    if args.output:
        writable_dir(str(Path(args.output).parent), "--output")
    from fleetllm.speculative.eagle import head_path
    from fleetllm.speculative.train import train

    out = Path(args.output) if args.output else head_path(args.target, args.method)
    train(args.method, args.target, out, args.minutes, args.batch_size, args.lr, args.seed, args.text_tokens,
          args.chats, args.threads)
    return 0


def add_worker_parser(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("worker", help="serve one engine over the OpenAI-compatible API")
    add_options(w, EngineConfig, title="engine")
    add_options(w, StoreConfig, title="model store (hf:// and s3:// models)")
    add_options(w, ListenOptions, defaults={"port": 8001}, title="server")
    add_options(w, WorkerOptions, title="worker identity (labels on every metric)")
    add_options(w, PinningOptions, title="cores")
    add_options(w, ObservabilityConfig, title="observability")
    add_options(w, CaptureConfig, title="capture (worker tier)")
    add_options(w, ToolConfig, title="tool calling")
    add_options(w, KVEventsOptions, title="KV events in vLLM's format (ZMQ)")
    add_options(w, TransferOptions, title="KV transfer (disaggregated prefill/decode)")
    add_options(w, LoraServingOptions, title="LoRA adapters (with the engine's --enable-lora)")
    sim = w.add_argument_group("simulated worker")
    add_options(sim, SimulateOptions)
    add_options(sim, ProfileOption)
    add_options(sim, SimConfig, only=["speed", "lora_load_s"])
    w.set_defaults(func=cmd_worker)


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("router", help="OpenAI-compatible gateway routing over many workers")
    routing = r.add_argument_group("routing")
    add_options(routing, RouterConfig)
    add_options(routing, ProfileOption)
    from fleetllm.router.discovery.kubernetes import KubernetesDiscoveryConfig

    add_options(r, KubernetesDiscoveryConfig, title="--discover kubernetes")
    add_options(r, ListenOptions, title="server")
    add_options(r, ObservabilityConfig, only=["otlp_endpoint", "otlp_interval_s"], title="observability")
    add_options(r, CaptureConfig, title="capture (endpoint and access tiers)")
    r.set_defaults(func=cmd_router)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="start N workers and a router on this machine (a fleet)")
    add_options(s, ServeOptions)
    add_options(s, RunDirOption)
    add_options(s, EngineConfig, only=["model", "speculative", *TIER_FLAGS], title="every real worker",
                defaults=dict.fromkeys(TIER_FLAGS))  # None: the fleet YAML's engine: value stands
    add_options(s, EngineConfig, only=["scheduling_policy"], defaults={"scheduling_policy": None},
                title="every worker (overrides the config's engine settings)")
    # None: the fleet config's value stands unless the flag is given (the help shows the router's default).
    add_options(s, RouterConfig, only=["policy", "pd_threshold", "keys_file"], title="router",
                defaults={"policy": None, "pd_threshold": None, "keys_file": None})
    add_options(s, ObservabilityConfig, only=["otlp_endpoint"], title="router and every worker")
    # None: the fleet YAML's capture block stands unless a flag is given
    add_options(s, CaptureConfig, title="capture (router and every worker)",
                defaults={f.name: None for f in cli_fields(CaptureConfig)})
    s.set_defaults(func=cmd_serve)


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("calibrate", help="measure the engine's step times for the simulated worker's timing model")
    add_options(c, EngineConfig, only=["model"])
    c.add_argument("--num-threads", type=int, default=1)
    c.add_argument("--repeats", type=int, default=3,
                   help="sweeps over every point; the profile keeps each point's median over the sweeps")
    c.add_argument("--output", required=True)
    c.set_defaults(func=cmd_calibrate)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="answer one chat prompt in-process (no server)")
    add_options(g, EngineConfig, title="engine")
    add_options(g, StoreConfig, title="model store (hf:// and s3:// models)")
    g.add_argument("prompt", help="the user's message")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to answer (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    g.set_defaults(func=cmd_generate)


def add_spec_parser(sub: argparse._SubParsersAction) -> None:
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


def _positive_weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def cmd_keys(args: argparse.Namespace) -> int:
    from fleetllm.router.keys import KeyStore

    store = KeyStore(args.file)
    if args.keys_command == "create":
        rec, key = store.create(args.name, models=args.models.split(",") if args.models else [],
                                rpm_limit=args.rpm_limit, tpm_limit=args.tpm_limit,
                                max_parallel_requests=args.max_parallel_requests,
                                priority_floor=args.priority_floor, weight=args.weight, admin=args.admin)
        print(f"{rec.id}  {key}\n(the key is shown once; {args.file} keeps only its hash)")
    elif args.keys_command == "revoke":
        try:
            print(f"revoked {store.revoke(args.id).id}")
        except KeyError as e:
            raise UsageError(e.args[0]) from None
    else:
        for rec in store.records():
            print(json.dumps(rec.public()))
    return 0


def add_keys_parser(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("keys", help="API keys of a fleet: create, ls, revoke (the router re-reads the file)")
    k.add_argument("--file", default="keys.yaml", help="the keys file (the fleet YAML's keys_file)")
    ks = k.add_subparsers(dest="keys_command", required=True)
    c = ks.add_parser("create", help="a new key, printed once")
    c.add_argument("--name", default="", help="a name to find it by")
    c.add_argument("--models", default=None, help="comma-separated models it may call (default: all)")
    c.add_argument("--rpm-limit", type=int, default=None, help="requests per minute")
    c.add_argument("--tpm-limit", type=int, default=None, help="prompt + output tokens per minute")
    c.add_argument("--max-parallel-requests", type=int, default=None, help="requests in flight at once")
    c.add_argument("--priority-floor", type=int, default=None,
                   help="the most urgent priority its requests may ask for (more urgent ones, the default 0 "
                        "included, are served at this one)")
    c.add_argument("--weight", type=_positive_weight, default=1.0,
                   help="its share of a saturated fleet against the other keys of a priority band (router "
                        "--flow-control)")
    c.add_argument("--admin", action="store_true", help="may read /metrics, /router/state and /admin/*")
    ks.add_parser("ls", help="every key's id, name, limits (never the key)")
    r = ks.add_parser("revoke", help="refuse a key from the next request on")
    r.add_argument("id", help="the key's id (key-...) or name")
    k.set_defaults(func=cmd_keys)


def cmd_recommend(args: argparse.Namespace) -> int:
    import json as json_module

    from fleetllm.recommend.recommend import RecommendConfig, run_recommend

    doc = run_recommend(from_args(RecommendConfig, args))
    if args.json:
        print(json_module.dumps(doc, indent=2, default=str))
    return 0


def add_recommend_parser(sub: argparse._SubParsersAction) -> None:
    from fleetllm.recommend.config import RecommendConfig

    r = sub.add_parser("recommend", help="the deployment that meets the SLOs at the lowest cost (predicted, "
                                         "checked by measurement with --validate)")
    add_options(r, RecommendConfig)
    r.set_defaults(func=cmd_recommend)


# Each command and what adds its parser: the other packages' as "module:function", imported only when their
# command runs or the whole CLI is built, so a process running one command (a worker's cold start, a router's)
# skips the others' modules (bench's rich, capture's cryptography, the deploy and fleet tools).
COMMANDS: dict[str, Callable[[argparse._SubParsersAction], object] | str] = {
    "worker": add_worker_parser,
    "router": add_router_parser,
    "serve": add_serve_parser,
    "calibrate": add_calibrate_parser,
    "generate": add_generate_parser,
    "spec": add_spec_parser,
    "keys": add_keys_parser,
    "capture": "fleetllm.capture.cli:add_capture_parser",
    "models": "fleetllm.store.cli:add_models_parser",
    "recommend": add_recommend_parser,
    "fleet": "fleetllm.fleet.cli:add_fleet_parser",
    "deploy": "fleetllm.deploy.cli:add_deploy_parser",
    "bench": "fleetllm.bench.cli:add_bench_parser",  # left out when its extras are not installed
    "doctor": "fleetllm.doctor:add_doctor_parser",
}


@functools.cache
def worker_flags() -> frozenset[str]:
    """Every long flag of ``fleetllm worker`` (what a fleet YAML's ``engine:`` settings become)."""
    parser = build_parser("worker")
    return frozenset(f for f in command_parsers(parser, parser.parse_args(["worker"]))[-1]._option_string_actions
                     if f.startswith("--") and f != "--help")


class Parser(argparse.ArgumentParser):
    """argparse's parser whose mistakes are a :class:`UsageError` (one line, the nearest choice named): every
    subcommand's parser is one too (argparse makes subparsers of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        choice = re.match(r"argument .*: invalid choice: '(.*)' \(choose from (.*)\)$", message)
        if choice:
            message += did_you_mean(choice[1], re.findall(r"'([^']*)'", choice[2]))
        for sub in (a for a in self._actions if isinstance(a, argparse._SubParsersAction)):
            if message == f"the following arguments are required: {sub.dest}":  # its name is no word of the user's
                message = f"a command is required: {', '.join(sub.choices)}"
        raise UsageError(f"{message} (see `{self.prog} --help`)", prog=self.prog)

    def reject_extras(self, extras: list[str], parents: list[argparse.ArgumentParser]) -> NoReturn:
        """Refuse arguments no parser took, naming the nearest flag of this (sub)command, or the command before
        it that a flag belongs to (``fleetllm keys --file F create``)."""
        flag = next((e.split("=", 1)[0] for e in extras if e.startswith("--")), None)
        owner = next((p for p in reversed(parents) if flag in p._option_string_actions), None)
        hint = did_you_mean(flag, self._option_string_actions) if flag else ""
        if owner is not None:
            sub = self.prog.removeprefix(owner.prog).strip()
            hint = f"; {flag} is a flag of `{owner.prog}`: give it before `{sub}`"
        self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI; with ``command`` (one of :data:`COMMANDS`), only that command's parser."""
    parser = Parser(prog="fleetllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in [command] if command in COMMANDS else COMMANDS:
        add = COMMANDS[name]
        if isinstance(add, str):
            module, function = add.split(":")
            try:
                add = getattr(importlib.import_module(module), function)
            except ImportError:
                if name != "bench":
                    raise
                continue
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    logging.getLogger("botocore").setLevel(logging.WARNING)  # "Found credentials in ...": noise on every S3 command
    # httpx's own command line (httpx._main, which imports rich, click and pygments: ~50 ms) is no part of
    # fleetllm; marked absent, ``import httpx`` skips it (the router, the fleet and bench import httpx).
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    prog = parser.prog
    try:
        args, extras = parser.parse_known_args(argv)
        chain = command_parsers(parser, args)
        if extras:
            chain[-1].reject_extras(extras, chain[:-1])
        prog = chain[-1].prog
        return args.func(args) or 0
    except (UsageError, StoreError) as e:  # a user's mistake, or a model source that refused: one line, exit 2
        print(f"{getattr(e, 'prog', None) or prog}: error: {one_line(str(e))}", file=sys.stderr)
        return 2


def command_parsers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Parser]:
    """The parsers from ``parser`` down to the (sub)command ``args`` was parsed for: ``fleetllm``, ``fleetllm
    models``, ``fleetllm models pull`` for that command."""
    chain = [parser]
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, sub.dest, None) if sub else None
        if name not in (sub.choices if sub else {}):
            return chain  # type: ignore[return-value]  # built by Parser, as every subparser
        parser = sub.choices[name]
        chain.append(parser)


if __name__ == "__main__":
    sys.exit(main())

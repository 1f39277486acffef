"""Shared fixtures: the model loaded once per session, and real workers served in-process.

A worker here is what ``fleetllm worker FLAGS`` runs — the same flags parsed by the same CLI parser
into an :class:`LLMEngine` behind a :class:`Worker` app — but served by uvicorn on a thread of the test
process, over the session's one copy of the weights. Tests about processes (signals, restarts,
``fleetllm serve``) start real ones through ``fleet_helpers``.

Test modules get workers through fixtures (nothing needs importing from here): ``worker`` is a worker
with default flags, one per session; ``worker_factory(*flags)`` starts one with flags and stops it when
the module ends, e.g.::

    @pytest.fixture(scope="module")
    def small_worker(worker_factory):
        return worker_factory("--max-model-len", "64")
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime (as `fleetllm worker` does): spinning OpenMP threads would
# starve the in-process HTTP threads that share the cores with each engine step.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Under pytest-xdist the cores are shared by the test processes: each takes its share of torch threads
# (worker processes the tests start size themselves with --num-threads).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

# httpx's own command line (httpx._main: rich, click, pygments) is used by no test; as `fleetllm` does, it is
# marked absent so that `import httpx` skips it.
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
import httpx  # noqa: E402
import pytest  # noqa: E402
from fleet_helpers import ThreadServer, free_port, kv_sized  # noqa: E402

if TYPE_CHECKING:
    from families import FamilyModels

    from fleetllm.fleet.redis_server import RedisServer
    from fleetllm.models.loader import LoadedModel

MODEL = "smollm2-135m"
STARTUP_TIMEOUT_S = 120.0
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # as `fleetllm` logs


def child_processes() -> list[str]:
    """Processes whose parent is the test process, as "pid command"."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - read at once
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            out.append(f"{pid} {stat.split('(', 1)[1].rsplit(')', 1)[0]}")
    return out


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """The suite leaves no in-process server, engine thread or child process running (but the
    background preparations below, which pytest_sessionfinish stops)."""
    yield
    threads = [t.name for t in threading.enumerate() if t.name.startswith(("uvicorn-", "engine-loop"))]
    assert not threads, f"threads left running: {threads}"
    left = [p for p in child_processes() if int(p.split()[0]) not in {q.pid for q in _preparing}]
    assert not left, f"processes left running: {left}"


# Slow preparations several test files wait on, each made once per machine into the cache (under a lock, so
# a test that gets there first waits for it rather than doing it again): started, niced, from the session's
# start (by the controlling process under pytest-xdist), when the run includes a file that needs it.
_PREPARATIONS = {
    # HF transformers' own conversion of SmolLM2's GGUF (~17 s of CPU), saved as a HF directory
    "hf_reference.py": ("engine/test_hf_equivalence.py", "models/test_loader.py", "models/test_families_gguf.py"),
    # tiny mixture-of-experts models converted by llama.cpp's own converter (~17 s each)
    "families.py": ("models/test_families_gguf.py",),
    # Gemma-3-270M's weights dequantised (~13 s); where the entry exists, only checked (torch and the 262k-token
    # tokenizer read for nothing cost ~3 s)
    "-c from pathlib import Path; from fleetllm.models.source import dequant_cache_dir, resolve\n"
    "p = Path(resolve('gemma3-270m'))\n"
    "if not (dequant_cache_dir(p) / 'done').exists():\n"
    "    from fleetllm.models.loader import read_gguf; read_gguf(p)":
        ("models/test_gemma3.py", "fleet/test_fleet_control.py"),
}
_preparing: list[subprocess.Popen] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _write_bytecode(session)
    here = Path(__file__).parent
    asked = [(session.config.invocation_params.dir / a.split("::")[0]).resolve() for a in session.config.args]
    for what, files in _PREPARATIONS.items():
        needed = [(here / f).resolve() for f in files]
        if any(f == a or a in f.parents for f in needed for a in asked):
            cmd = [sys.executable, *what.split(" ", 1)] if what.startswith("-c") else [sys.executable, str(here / what)]
            _preparing.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                               preexec_fn=lambda: os.nice(10)))


def _write_bytecode(session: pytest.Session) -> None:
    """Under pytest-xdist, the test files' bytecode written once, over two processes, before the test processes
    start and each import every test file (tests/bytecode_cache.py says why)."""
    if not getattr(session.config.option, "numprocesses", None):
        return
    import bytecode_cache

    files = bytecode_cache.stale(sorted(p for p in Path(__file__).parent.rglob("*.py") if "__pycache__" not in p.parts))
    writers = [subprocess.Popen([sys.executable, bytecode_cache.__file__, *map(str, files[i::2])])
               for i in range(2) if files[i::2]]
    for w in writers:
        w.wait()


# The suite's longest files (CPU seconds in a whole run), started first: under pytest-xdist each file runs whole
# on one process, and a long file begun last would leave the other processes idle while it ends the run.
_LONGEST_FIRST = [
    "packaging/test_wheel.py", "fleet/test_fleet_control.py", "speculative/test_spec_greedy.py", "disagg/test_pd_fleet.py",
    "observability/test_fleet_observability.py", "agents/test_structured_outputs.py", "router/test_router_http.py",
    "server/test_errors.py", "reliability/test_drain.py", "agents/test_tool_calls.py", "store/test_hub.py",
    "server/test_disconnect.py", "fleet/test_ray_fleet.py", "engine/test_kv_cache_dtype.py",
]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    rank = {str(here / f): i for i, f in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))  # stable: the rest keep their order


def pytest_sessionfinish(session: pytest.Session) -> None:
    for p in _preparing:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    """SmolLM2-135M's weights and tokenizer, loaded once per session. Engines only read them: share
    them through ``LLMEngine(config, loaded=...)`` / ``LLM(loaded=...)``; a test that changes weights
    (e.g. quantizes them) loads its own copy."""
    import torch

    from fleetllm.engine.engine import EngineConfig
    from fleetllm.models.loader import load_model

    device = EngineConfig().resolved_device()
    return load_model(MODEL, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)


@pytest.fixture
def model_worker() -> Iterator[Callable[..., InProcessWorker]]:
    """``start(loaded, *flags)`` -> a started worker over another model's weights; stopped with the test."""
    started: list[InProcessWorker] = []

    def start(loaded: LoadedModel, *flags: str) -> InProcessWorker:
        started.append(InProcessWorker(loaded, *flags))
        return started[-1]

    yield start
    for w in started:
        w.stop()


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory, loaded_model: LoadedModel) -> Iterator[FamilyModels]:
    """Tiny HF models of every family beyond Llama/Qwen/Gemma 3 (tests/families.py), each built on first use."""
    pytest.importorskip("transformers")
    from families import FamilyModels

    models = FamilyModels(tmp_path_factory.mktemp("families"), loaded_model.tokenizer.tok.to_str())
    yield models
    models.remove()


class ThreadLog(logging.Handler):
    """The ``fleetllm`` log records emitted on one thread (an in-process worker's server thread, where
    its request log is written), formatted as the CLI formats them: that worker's log."""

    def __init__(self, thread_name: str) -> None:
        super().__init__(logging.INFO)
        self.thread_name = thread_name
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if record.threadName == self.thread_name:
            self.lines.append(self.format(record))


class InProcessWorker:
    """``fleetllm worker FLAGS`` served on a thread of the test process, over shared weights."""

    def __init__(self, loaded: LoadedModel, *flags: str) -> None:
        import torch
        from prometheus_client import disable_created_metrics

        from fleetllm.cli import build_parser, engine_config, observability_config
        from fleetllm.cli_options import from_args
        from fleetllm.engine.engine import LLMEngine
        from fleetllm.lora.options import LoraServingOptions
        from fleetllm.server.app import Worker
        from fleetllm.store.config import StoreConfig
        from fleetllm.tools.config import ToolConfig

        disable_created_metrics()  # as `fleetllm worker` does
        port = free_port()
        args = build_parser().parse_args(["worker", "--host", "127.0.0.1", "--port", str(port), *kv_sized(flags)])
        threads = torch.get_num_threads()
        # a quantised engine takes a copy sharing these weights (quantize_model never changes the model it is given)
        engine = LLMEngine(engine_config(args), loaded=loaded)
        torch.set_num_threads(threads)  # --num-threads sizes a worker process; the test process keeps its own
        self.worker = Worker(engine, observability_config(args), role=args.role, tools=from_args(ToolConfig, args),
                             lora=from_args(LoraServingOptions, args), store=from_args(StoreConfig, args))
        self.base_url = f"http://127.0.0.1:{port}"  # the OpenAI base URL is base_url + "/v1"
        self.server = ThreadServer(self.worker.app, port, on_exit=lambda: setattr(self.worker, "closing", True),
                                   startup_timeout=STARTUP_TIMEOUT_S)
        self._log = ThreadLog(self.server.thread.name)
        logger = logging.getLogger("fleetllm")
        logger.setLevel(logging.INFO)  # as the CLI's logging.basicConfig(level=INFO)
        logger.addHandler(self._log)
        try:
            self.server.start()
        except BaseException:
            logger.removeHandler(self._log)
            raise

    @property
    def url(self) -> str:
        return self.base_url

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return "\n".join(self._log.lines)

    def metrics(self) -> dict[str, float]:
        return scrape(self.base_url)

    def wait_for_metrics(self, ok: Callable[[dict[str, float]], bool], deadline_s: float = 30.0) -> dict[str, float]:
        return wait_for_metrics(self.base_url, ok, deadline_s)

    def wait_idle(self, deadline_s: float = 30.0) -> dict[str, float]:
        """Wait until nothing runs or waits and every KV block is free (fails after the deadline)."""
        return wait_for_metrics(self.base_url, idle, deadline_s)

    def stop(self) -> None:
        """Stop the server (its lifespan stops the engine thread and any OTLP pusher)."""
        try:
            self.server.stop()
        finally:
            logging.getLogger("fleetllm").removeHandler(self._log)


@pytest.fixture(scope="session")
def worker(loaded_model: LoadedModel) -> Iterator[InProcessWorker]:
    """A worker with default flags, shared by the session (tests measure metric deltas, not totals)."""
    w = InProcessWorker(loaded_model)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def worker_factory(loaded_model: LoadedModel) -> Iterator[Callable[..., InProcessWorker]]:
    """``start(*flags)`` -> a started worker; every worker it started is stopped with the module."""
    started: list[InProcessWorker] = []

    def start(*flags: str) -> InProcessWorker:
        w = InProcessWorker(loaded_model, *flags)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


# ---- /metrics -------------------------------------------------------------------------------------
def scrape(base_url: str) -> dict[str, float]:
    """``/metrics`` as {sample name: value}, labels dropped (a worker serves one model); samples
    sharing a name (e.g. request_success by reason) are summed."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if "_bucket" in name:
            continue
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_for_metrics(base_url: str, ok: Callable[[dict[str, float]], bool], deadline_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until ``ok`` holds; fail with the last values after a generous deadline."""
    end = time.monotonic() + deadline_s
    m = scrape(base_url)
    while not ok(m):
        if time.monotonic() > end:
            pytest.fail(f"metrics never satisfied the condition within {deadline_s}s: {m}")
        time.sleep(0.05)
        m = scrape(base_url)
    return m


def idle(m: dict[str, float]) -> bool:
    """No request running or waiting, and every KV block free."""
    return (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0)


# ---- S3 + KMS on 127.0.0.1 --------------------------------------------------------------------------
class S3Server:
    """A real S3 and KMS API (``moto[server]``) in its own process on 127.0.0.1, reached only through
    boto3 with ``endpoint_url``. One per session: tests use their own buckets."""

    def __init__(self) -> None:
        import subprocess
        import sys

        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.endpoint_url + "/moto-api/", timeout=2)
                break
            except httpx.TransportError:
                if self.popen.poll() is not None or time.monotonic() > end:
                    self.stop()
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)

    def client(self, service: str = "s3"):  # noqa: ANN201 - a boto3 client
        """A boto3 client for ``service`` ("s3", "kms") pointed at this server, with dummy credentials."""
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint_url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def env(self) -> dict[str, str]:
        """Environment for a child process (e.g. ``fleetllm serve``) that talks to this server."""
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint_url}

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except Exception:
                self.popen.kill()
                self.popen.wait()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session's S3 + KMS endpoint (started on first use, stopped at the end of the session)."""
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One ``redis-server`` for the whole session on a free 127.0.0.1 port, nothing kept on disk; stopped at
    the end. Tests share it: each names its own keys (a fresh API key id, say). A test that kills it must
    ``start()`` it again before it ends (same port, empty)."""
    from fleetllm.fleet.redis_server import RedisServer

    server = RedisServer().start()
    yield server
    server.stop()

"""Start, watch and stop a fleet: N worker processes and a router process on one machine.

Start order: workers (one process per placed copy, pinned to its reserved cores; simulated copies run up to ``SIM_PER_PROCESS``
per process), wait until each answers /health, then the router, then wait until the router sees
every worker healthy. On SIGINT/SIGTERM the router stops first (no new requests), then the workers;
anything still alive after a grace period is killed, so no process outlives the fleet. With
``restart`` (the default) a worker process that dies is started again on the same port; the router
notices the new instance through its KV-event stream and re-syncs its prefix index.

SIGHUP (what ``fleetllm fleet restart`` sends, finding the serve by the state file it leaves, see
:mod:`fleetllm.fleet.runfile`) rolls a restart through the workers, one process at a time: SIGTERM (the worker drains: the
router stops routing to it at its "draining" event, in-flight requests finish), start it again, wait
until it is ready and the router routes to it, then the next. No request fails when the fleet has
more than one worker process.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fleetllm.cli_options import to_argv
from fleetllm.errors import UsageError, one_line
from fleetllm.fleet import runfile
from fleetllm.fleet.config import FleetConfig, ModelSpec
from fleetllm.fleet.placement import Copy, Placer, place
from fleetllm.fleet.redis_server import RedisServer, RedisUnavailable
from fleetllm.fleet.router_args import model_router_args
from fleetllm.router.admin_token import FILE_NAME as ADMIN_TOKEN_FILE
from fleetllm.router.admin_token import load_or_mint
from fleetllm.router.backends import fleetllm_spec
from fleetllm.router.state_url import AUTO
from fleetllm.server.pinning import format_cpus
from fleetllm.server.worker_secret import ENV as SECRET_ENV
from fleetllm.server.worker_secret import worker_secret
from fleetllm.store.pin import pin, pin_adapter, token_envs

log = logging.getLogger(__name__)
SIM_PER_PROCESS = 64
PY = [sys.executable, "-m", "fleetllm.cli"]


@dataclass
class Proc:
    name: str
    cmd: list[str]
    urls: list[str]  # the base URLs this process serves
    log_path: Path
    cpus: list[int] | None = None  # the cores placement reserved (the worker pins itself: --cpus)
    zone: str = ""
    role: str = "both"
    copies: list[Copy] = field(default_factory=list)  # the model copies it serves (empty for the router)
    env: dict[str, str] = field(default_factory=dict)  # secrets travel here, never on the command line
    hide: list[str] = field(default_factory=list)  # variables of the fleet's environment it must not see
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    def start(self) -> None:
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        env = {k: v for k, v in os.environ.items() if k not in self.hide}
        try:
            self.popen = subprocess.Popen(self.cmd, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**env, **self.env, "PYTHONUNBUFFERED": "1"})
        finally:
            os.close(fd)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Fleet:
    discovers = False  # the router is told of copies (a Ray fleet's router finds them itself)
    picks_ports = True  # copies listen where the fleet says (a Ray actor picks a free port on its node)

    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="fleetllm-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers: list[Proc] = []
        self.router: Proc | None = None
        self.placer = Placer(cfg.machines)
        self._next_port = cfg.worker_port or cfg.port + 1
        self._otlp = ["--otlp-endpoint", cfg.otlp_endpoint] if cfg.otlp_endpoint else []
        self._capture = to_argv(cfg.capture)  # the --capture-* flags of the router and every real worker
        # workers take requests from their fleet only (fleetllm/server/worker_secret.py); the secret lives in
        # the processes' environment, never in a file or on a command line
        self.secret = worker_secret() or secrets.token_urlsafe(32)  # a platform's (Kubernetes: a Secret), else new
        self._env = {SECRET_ENV: self.secret}
        # the admin credential (fleetllm/router/admin_token.py), distinct from the secret: the controller's and
        # the operator's, in a 0600 file
        self.admin_token, self.admin_token_file = load_or_mint(cfg.admin_token_file or self.log_dir / ADMIN_TOKEN_FILE)
        # hf:// and s3:// sources resolve once, now: every copy and the router's tokenizer get the same commit
        pinned = {id(m): pin(m.source, m.engine) for m in cfg.models}
        self._sources = {k: source for k, (source, _) in pinned.items()}
        self._tokenizers = {k: tokenizer for k, (_, tokenizer) in pinned.items()}
        for m in cfg.models:  # LoRA adapters' sources likewise, each with its own token
            m.adapters = [pin_adapter(a, m.engine) for a in m.adapters]
        self._plan()

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    @property
    def worker_headers(self) -> dict[str, str]:
        """What the fleet's own workers take a request with (reading their /metrics, say)."""
        return {"authorization": f"Bearer {self.secret}"}

    @property
    def worker_urls(self) -> list[str]:
        return [u for p in self.workers for u in p.urls] + list(self.cfg.external)

    @property
    def zones(self) -> list[str]:
        """The zone of each of ``worker_urls``."""
        return [p.zone for p in self.workers for _ in p.urls] + [""] * len(self.cfg.external)

    @property
    def models(self) -> list[str]:
        """The served model of each of ``worker_urls`` ("" for external workers: they say themselves)."""
        return [p.copies[0].model.served_name for p in self.workers for _ in p.urls] + [""] * len(self.cfg.external)

    @property
    def roles(self) -> list[str]:
        """The P/D role of each of ``worker_urls``."""
        return [p.role for p in self.workers for _ in p.urls] + ["both"] * len(self.cfg.external)

    @property
    def variants(self) -> list[str]:
        """The variant of each of ``worker_urls`` ("" unless its model is split)."""
        return [p.copies[0].model.variant or "" for p in self.workers for _ in p.urls] + [""] * len(self.cfg.external)

    def procs_of(self, m: ModelSpec) -> list[Proc]:
        """The worker processes serving copies of the fleet entry ``m``."""
        return [p for p in self.workers if any(c.model is m for c in p.copies)]

    def _plan(self) -> None:
        """Worker processes for every placed copy, then the router over all of them."""
        copies = place(self.cfg, self.placer)
        for c in copies:
            if not c.model.simulate:
                self._add_real(c)
        sims: dict[tuple[int, str], list[Copy]] = {}
        for c in copies:
            if c.model.simulate:
                sims.setdefault((id(c.model), c.zone), []).append(c)
        for group in sims.values():
            for i in range(0, len(group), SIM_PER_PROCESS):
                self._add_sim(group[i:i + SIM_PER_PROCESS])
        self.router = Proc("router", [*PY, "router", *self._router_args()], [self.url], self.log_dir / "router.log",
                           env=self._env)

    def _model_args(self, m: ModelSpec) -> list[str]:
        return ["--model", self._sources.get(id(m), m.source), "--served-model-name", m.served_name, *m.worker_args()]

    def _hidden(self, m: ModelSpec) -> list[str]:
        """Other models' token variables: a worker never sees another model's token."""
        own = set(token_envs(m.engine)) | {a.token_env for a in m.adapters if a.token_env}
        every = [v for o in self.cfg.models for v in [*token_envs(o.engine), *(a.token_env for a in o.adapters)] if v]
        return [v for v in dict.fromkeys(every) if v not in own]

    def _add_real(self, c: Copy) -> Proc:
        port, self._next_port = self._next_port, self._next_port + 1
        # pinned by its own --cpus (before torch starts its threads); threads = its cores unless the model sets them
        pin = ["--cpus", format_cpus(c.cpus)] if c.cpus else []
        threads = [] if "num_threads" in c.model.engine else ["--num-threads", str(c.threads)]
        cmd = [*PY, "worker", *self._model_args(c.model), *threads, *pin, "--host", self.cfg.host, "--port", str(port),
               "--role", c.model.role, "--zone", c.zone, "--log-level", "warning", *self._otlp, *self._capture]
        proc = Proc(f"worker-{port}", cmd, [f"http://{self.cfg.host}:{port}"], self.log_dir / f"worker-{port}.log",
                    cpus=c.cpus, zone=c.zone, role=c.model.role, copies=[c], env=self._env,
                    hide=self._hidden(c.model))
        self.workers.append(proc)
        return proc

    def _add_sim(self, group: list[Copy]) -> Proc:
        port, n = self._next_port, len(group)
        self._next_port += n
        cmd = [*PY, "worker", "--simulate", "--count", str(n), *self._model_args(group[0].model), "--host",
               self.cfg.host, "--port", str(port), "--zone", group[0].zone, "--log-level", "warning", *self._otlp,
               *self._capture]
        urls = [f"http://{self.cfg.host}:{port + i}" for i in range(n)]
        proc = Proc(f"sim-{port}", cmd, urls, self.log_dir / f"sim-{port}.log", zone=group[0].zone, copies=group,
                    env=self._env, hide=self._hidden(group[0].model))
        self.workers.append(proc)
        return proc

    def _worker_list_args(self) -> list[str]:
        """The router's worker list: every copy's URL and labels (a Ray fleet's router discovers its own)."""
        own = [fleetllm_spec(u) for p in self.workers for u in p.urls]
        args = ["--workers", ",".join(own + list(self.cfg.external))]
        if self.worker_urls:
            args += ["--worker-models", ",".join(self.models)]
        if any(self.variants):
            args += ["--worker-variants", ",".join(self.variants)]
        if any(self.zones):
            args += ["--zones", ",".join(self.zones)]
        if any(r != "both" for r in self.roles):
            args += ["--roles", ",".join(self.roles)]
        return args

    def _router_args(self) -> list[str]:
        cfg = self.cfg
        args = [*self._worker_list_args(), "--policy", cfg.policy, "--host", cfg.host,
                "--port", str(cfg.port), "--log-level", "warning", *self._otlp, *self._capture,
                *model_router_args(cfg, self._tokenizers)]
        if cfg.pd_threshold is not None:
            args += ["--pd-threshold", str(cfg.pd_threshold)]
        if cfg.keys_file:
            args += ["--keys-file", cfg.keys_file]
        if cfg.state_url:  # run_fleet has started the store by now when it is `auto`
            args += ["--state-url", cfg.state_url]
        if "--batch-dir" not in cfg.router_args:  # this fleet's batches, not every fleet's of this user
            args += ["--batch-dir", str(self.log_dir / "batches")]
        return args + ["--admin-token-file", str(self.admin_token_file)] + cfg.router_args

    # ---- copies added and removed while the fleet runs (the autoscaler's hands) ---------------------
    def add_copy(self, m: ModelSpec) -> Proc:
        """Place and start one more copy of ``m`` in its own process; the caller waits until it is ready."""
        c = self.placer.add(m)
        proc = self._add_sim([c]) if m.simulate else self._add_real(c)
        proc.start()
        return proc

    def remove(self, proc: Proc, grace_s: float = 20.0) -> None:
        """Stop one worker process (SIGTERM, then SIGKILL) and give its resources back."""
        self.workers.remove(proc)  # first: the supervisor must not restart what is being stopped
        _terminate([proc], grace_s)
        for c in proc.copies:
            self.placer.release(c)

    # ---- lifecycle --------------------------------------------------------------------------------
    def _check_ports_free(self, p: Proc) -> None:
        if self.picks_ports:
            _check_ports_free(p)

    def start(self) -> None:
        """Start everything and return once the router sees every worker healthy (raises otherwise)."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        try:
            for p in self.workers:
                self._check_ports_free(p)
            for p in self.workers:
                p.start()
            for p in self.workers:
                for u in p.urls:
                    self.wait_healthy(p, u + "/ready", deadline)  # loaded and warm
            assert self.router is not None
            self.router.start()
            self.wait_healthy(self.router, self.url + "/health", deadline)
            self._wait_router_sees_all(deadline)
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, p: Proc, url: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not p.alive:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode if p.popen else '?'}:\n{p.log_tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{p.name} not healthy in time ({url}):\n{p.log_tail()}")

    def _wait_router_sees_all(self, deadline: float) -> None:
        n = len(self.worker_urls)
        while time.monotonic() < deadline:
            try:
                auth = {"authorization": f"Bearer {self.admin_token}"}
                state = httpx.get(self.url + "/router/state", headers=auth, timeout=2).json()
                if sum(w["healthy"] for w in state["workers"]) == n:
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise TimeoutError("the router did not see every worker healthy in time")

    def stop(self, grace_s: float = 20.0) -> None:
        """Router first, then workers: SIGTERM, wait, then SIGKILL whatever is left."""
        _terminate([self.router] if self.router else [], grace_s)
        _terminate(self.workers, grace_s)

    def rolling_restart(self, drain_grace_s: float = 60.0) -> None:
        """Restart every worker process in turn, each back and routed to before the next one stops."""
        for p in list(self.workers):
            if p not in self.workers:  # removed meanwhile (autoscaler)
                continue
            log.info("rolling restart: %s", p.name)
            _terminate([p], drain_grace_s)
            self._check_ports_free(p)  # else the next /ready could be another process's, and the roll a lie
            p.restarts += 1
            p.start()
            deadline = time.monotonic() + self.cfg.startup_timeout_s
            for u in p.urls:
                self.wait_healthy(p, u + "/ready", deadline)
            self._wait_router_sees_all(deadline)
        log.info("rolling restart done: %d worker process(es)", len(self.workers))

    def supervise(self, should_stop: Callable[[], bool], tick: Callable[[], object] | None = None,
                  tick_s: float = 2.0, restart_requested: Callable[[], bool] = lambda: False,
                  rolled: Callable[[str], object] = lambda error: None) -> None:
        """Block until ``should_stop()``; restart dead workers when configured to; roll a restart through
        the workers when ``restart_requested()``, then call ``rolled`` with why it stopped ("" if it went
        through); call ``tick`` (the fleet controller) every ``tick_s``."""
        next_tick = time.monotonic() + tick_s
        while not should_stop():
            if restart_requested():
                error = ""
                try:
                    self.rolling_restart()
                except (RuntimeError, TimeoutError) as e:
                    error = str(e).splitlines()[0]
                    log.error("rolling restart stopped: %s", e)
                rolled(error)
            for p in list(self.workers):
                if not p.alive and self.cfg.restart:
                    p.restarts += 1
                    log.warning("%s exited (%s); restarting (restart %d)", p.name,
                                p.popen.returncode if p.popen else "?", p.restarts)
                    p.start()
            if self.router is not None and not self.router.alive:
                log.error("the router exited:\n%s", self.router.log_tail())
                return
            if tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + tick_s
                try:
                    tick()
                except Exception:  # a failed round of autoscaling must not take the fleet down
                    log.exception("fleet controller tick failed")
            time.sleep(0.5)


def _check_ports_free(p: Proc) -> None:
    """Raise if another process listens on one of ``p``'s ports (its health checks would answer for ``p``)."""
    for u in p.urls:
        host, port = u.removeprefix("http://").rsplit(":", 1)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no clash
            try:
                s.bind((host, int(port)))
            except OSError as e:
                raise RuntimeError(f"{p.name}: port {port} is in use by another process ({e.strerror})") from None


def _terminate(procs: list[Proc], grace_s: float) -> None:
    live = [p for p in procs if p.alive]
    for p in live:
        p.popen.terminate()  # type: ignore[union-attr]
    end = time.monotonic() + grace_s
    for p in live:
        try:
            p.popen.wait(timeout=max(0.1, end - time.monotonic()))  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs: killed", p.name, grace_s)
            os.killpg(p.popen.pid, signal.SIGKILL)  # type: ignore[union-attr]
            p.popen.wait()  # type: ignore[union-attr]


def run_fleet(cfg: FleetConfig, state_file: Path | None = None) -> int:
    """``fleetllm serve``: start the fleet, serve until SIGINT/SIGTERM, stop it cleanly. Once ready it
    leaves ``state_file`` (:mod:`fleetllm.fleet.runfile`) for ``fleetllm fleet restart`` and removes it on exit.
    ``state_url: auto`` or ``kv_remote: auto`` starts a private redis-server first (:func:`private_store`)
    and stops it last."""
    try:
        store = private_store(cfg)
    except RedisUnavailable as e:
        print(f"fleet failed to start: {e}", file=sys.stderr)
        return 1
    try:
        return _serve(cfg, state_file)
    finally:
        if store is not None:
            store.stop()


def private_store(cfg: FleetConfig) -> RedisServer | None:
    """The one redis-server a fleet asking ``auto`` gets (None: none asks), started, its URL put where ``auto``
    stood: the router's ``state_url`` and every model's ``engine: {kv_remote}``. Keys are prefixed by purpose
    (``fleetllm:rl:``, ``fleetllm:<ns>:resp:``, ``fleetllm:kv:``). With the KV tier on it, it holds at most
    :func:`kv_store_bytes` and evicts the least recently used keys (a KV block, mostly: limit counters are
    touched by every request; a response turn evicted is as one expired)."""
    kv = [m for m in cfg.models if m.engine.get("kv_remote") == AUTO]
    if cfg.state_url != AUTO and not kv:
        return None
    what = " and ".join(w for w, on in (("--state-url auto", cfg.state_url == AUTO), ("--kv-remote auto", kv)) if on)
    try:
        store = RedisServer(max_memory=kv_store_bytes() if kv else None).start()
    except RedisUnavailable as e:
        raise RedisUnavailable(f"{what}: {e}") from None
    if cfg.state_url == AUTO:
        cfg.state_url = store.url
    for m in kv:
        m.engine["kv_remote"] = store.url
    log.info("%s: a private redis-server at %s", what, store.url)
    return store


def kv_store_bytes() -> int:
    """What a private Redis holding the KV tier may hold: an eighth of the machine's memory (the workers' KV
    pools and host tiers need the rest; give ``--kv-remote redis://...`` of a Redis sized by hand otherwise)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8


def _serve(cfg: FleetConfig, state_file: Path | None) -> int:
    """:func:`run_fleet` once its state store (if any) is up."""
    try:
        if cfg.ray is not None:
            from fleetllm.fleet.ray_launcher import RayFleet

            fleet: Fleet = RayFleet(cfg)
        else:
            fleet = Fleet(cfg)
    except (OSError, ValueError) as e:  # the log directory or the admin token file cannot be made or read
        raise UsageError(one_line(e)) from None
    stop = {"now": False, "restart": False}

    def on_signal(sig: int, frame: object) -> None:
        stop["now"] = True

    def on_hup(sig: int, frame: object) -> None:
        stop["restart"] = True

    def restart_requested() -> bool:
        requested, stop["restart"] = stop["restart"], False
        return requested

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_hup)
    n = cfg.num_workers
    print(f"starting {n} worker(s) and the router (logs in {fleet.log_dir}) ...", flush=True)
    print(f"admin token file: {fleet.admin_token_file}", flush=True)
    t0 = time.monotonic()
    try:
        fleet.start()
    except (RuntimeError, TimeoutError) as e:
        print(f"fleet failed to start: {e}", file=sys.stderr)
        return 1
    print(f"fleet ready in {time.monotonic() - t0:.1f}s: {fleet.url}/v1 (policy {cfg.policy}, {n} workers: "
          f"{', '.join(fleet.worker_urls[:4])}{' ...' if n > 4 else ''})", flush=True)
    tick = None
    if any(m.autoscaled for m in cfg.models):
        from fleetllm.fleet.controller import FleetController, RouterAdmin

        tick = FleetController(fleet, RouterAdmin(fleet.url, fleet.admin_token)).tick
    state = runfile.RunState(os.getpid(), fleet.url, str(fleet.log_dir))

    def rolled(error: str) -> None:
        state.rolls, state.roll_error = state.rolls + 1, error
        if state_file is not None:
            runfile.write(state_file, state)

    try:
        if state_file is not None:
            runfile.write(state_file, state)
        fleet.supervise(lambda: stop["now"], tick, restart_requested=restart_requested, rolled=rolled)
    finally:
        if state_file is not None:
            state_file.unlink(missing_ok=True)
        fleet.stop()
    return 0

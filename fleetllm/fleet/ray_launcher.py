"""A fleet on a Ray cluster: every copy a Ray actor (fleetllm/fleet/ray_actor.py), the router on this machine.

It has the local :class:`~fleetllm.fleet.launcher.Fleet`'s face, so ``fleetllm serve`` and the fleet
controller (autoscaling) drive either, but three jobs move to Ray:

- placement: each actor asks for its copy's resources (CPUs, memory, GPUs, custom resources, a zone label)
  and the configured strategy (SPREAD by default) spreads the copies over the nodes; ``machines`` is unused;
- restarts: an actor whose worker died, that was killed, or whose node was lost is started again by Ray on a
  node with room (``max_restarts``), under the same name, at a new address;
- discovery: the router finds the copies by name in the fleet's Ray namespace and asks each where it listens
  (fleetllm/router/discovery/ray.py), so nobody keeps a list of URLs; scaling only adds and removes actors.

The actors belong to this process (not detached): if ``fleetllm serve`` dies, Ray removes them with it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

# before Ray loads: its C++ failure handler would take SIGTERM from the fleet (dump a stack and die, no drain)
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
import ray  # noqa: E402

from fleetllm.fleet.config import FleetConfig, Machine, ModelSpec, RaySettings  # noqa: E402
from fleetllm.fleet.launcher import PY, Fleet, Proc, _terminate  # noqa: E402
from fleetllm.fleet.placement import Copy  # noqa: E402
from fleetllm.fleet.ray_actor import ACTOR_PREFIX, WorkerActor, actor_options  # noqa: E402

log = logging.getLogger(__name__)


class ActorProc:
    """One copy as a Ray actor, with the face of a launcher :class:`Proc` (what the fleet controller uses)."""

    def __init__(self, name: str, copy: Copy, args: list[str], options: dict[str, Any], env: dict[str, str],
                 hide: list[str], zone_label: str) -> None:
        self.name, self.copies, self.role = name, [copy], copy.model.role
        m = copy.model
        self._ctor = (args, {"model": m.served_name, "variant": m.variant or "", "role": m.role}, env, hide,
                      zone_label)
        self._options = options
        self.actor: Any = None
        self.restarts = 0
        self._info: dict[str, str] = {}
        self._asking: Any = None  # an info() call not answered yet
        self._asked = 0.0

    def start(self) -> None:
        """Create the actor (once: Ray, not the fleet, restarts it)."""
        if self.actor is None:
            self.actor = ray.remote(WorkerActor).options(**self._options).remote(*self._ctor)

    def wait_info(self, deadline: float, other_than: str = "") -> dict[str, str]:
        """Block until the actor says where it listens (an address other than ``other_than``)."""
        while True:
            try:
                info = ray.get(self.actor.info.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"{self.name}: no node with room for it in time "
                                   f"({_wants(self._options)})") from None
            except ray.exceptions.ActorUnavailableError:  # being restarted: ask again
                info = {"url": other_than}
            if info["url"] != other_than:
                self._info = info
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not come back in time")
            time.sleep(0.2)

    @property
    def urls(self) -> list[str]:
        """Where the copy listens, as last answered (it moves when Ray restarts it elsewhere); never blocks."""
        now = time.monotonic()
        if self.actor is not None and now - self._asked > 1.0:
            self._asked = now
            self._asking = self._asking or self.actor.info.remote()
            if ray.wait([self._asking], timeout=0)[0]:
                try:
                    self._info = ray.get(self._asking)
                except ray.exceptions.RayError:
                    pass  # restarting, or gone: the last answer stands
                self._asking = None
        return [self._info["url"]] if self._info else []

    @property
    def zone(self) -> str:
        return self._info.get("zone", "")

    @property
    def alive(self) -> bool:
        return True  # Ray restarts a dead copy; the fleet's supervisor has nothing to do

    def log_tail(self, n: int = 20) -> str:
        return f"(the worker's output is in the Ray worker log of actor {self.name!r} on its node)"

    def stop(self, grace_s: float = 20.0, restart: bool = False) -> None:
        """Drain and stop the worker, then kill the actor: for good, or for Ray to start it again."""
        try:
            ray.get(self.actor.stop.remote(grace_s), timeout=grace_s + 5)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # its node is gone, or it is: killing it is all that is left
        ray.kill(self.actor, no_restart=not restart)


class RayFleet(Fleet):
    """The fleet with its copies as Ray actors; the router runs here and discovers them through Ray."""

    discovers = True
    picks_ports = False

    def __init__(self, cfg: FleetConfig) -> None:
        assert cfg.ray is not None
        self.ray_cfg: RaySettings = cfg.ray
        self._count: dict[str, int] = {}
        super().__init__(cfg)

    def _plan(self) -> None:
        for m in self.cfg.models:
            for _ in range(m.replicas.initial or 0):
                self.workers.append(self._actor(m))
        self.router = Proc("router", [*PY, "router", *self._router_args()], [self.url], self.log_dir / "router.log",
                           env=self._env)

    def _actor(self, m: ModelSpec) -> ActorProc:
        i = self._count[m.unit] = self._count.get(m.unit, -1) + 1
        name = f"{ACTOR_PREFIX}{m.unit}:{i}"
        copy = Copy(m, i, Machine(name="ray", zone=""), None)
        opts = actor_options(m, self.ray_cfg, name, i, self.cfg.restart)
        return ActorProc(name, copy, self._worker_args(m), opts, self._env, self._hidden(m), self.ray_cfg.zone_label)

    def _worker_args(self, m: ModelSpec) -> list[str]:
        """``fleetllm`` arguments of one copy; the actor adds where it listens (its node's address, a free port)."""
        common = ["--log-level", "warning", *self._otlp, *self._capture]
        if m.simulate:
            return ["worker", "--simulate", "--count", "1", *self._model_args(m), *common]
        threads = [] if "num_threads" in m.engine else ["--num-threads", str(m.resources.cores or 1)]
        return ["worker", *self._model_args(m), *threads, "--role", m.role, *common]

    def _worker_list_args(self) -> list[str]:
        return ["--workers", ",".join(self.cfg.external), "--ray-address", self.ray_cfg.address,
                "--ray-namespace", self.ray_cfg.namespace]

    def connect(self) -> None:
        """Join the cluster as a driver (the actors' owner)."""
        if ray.is_initialized():
            return
        # ray.init sets its own SIGTERM handler (exit at once): the fleet's, which stops it in order, stays
        kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        ray.init(address=self.ray_cfg.address, namespace=self.ray_cfg.namespace, log_to_driver=False,
                 logging_level=logging.ERROR)
        for s, handler in kept.items():
            if handler is not None:
                signal.signal(s, handler)

    def start(self) -> None:
        """Create every actor, wait until each says where it listens, then as the local fleet does."""
        self.connect()
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        try:
            for p in self.workers:
                p.start()
            for p in self.workers:
                p.wait_info(deadline)
        except BaseException:
            self.stop()
            raise
        super().start()

    def add_copy(self, m: ModelSpec) -> ActorProc:  # type: ignore[override]
        """One more actor for ``m``; Ray places it (it waits, pending, while no node has room)."""
        proc = self._actor(m)
        proc.start()
        self.workers.append(proc)
        return proc

    def remove(self, proc: ActorProc, grace_s: float = 20.0) -> None:  # type: ignore[override]
        self.workers.remove(proc)
        proc.stop(grace_s)

    def stop(self, grace_s: float = 20.0) -> None:
        """Router first, then every actor (its worker drains), then leave the cluster."""
        _terminate([self.router] if self.router else [], grace_s)
        if not ray.is_initialized():
            return
        live = [p for p in self.workers if p.actor is not None]
        stops = [p.actor.stop.remote(grace_s) for p in live]
        ray.wait(stops, num_returns=len(stops), timeout=grace_s + 5)
        for p in live:
            ray.kill(p.actor, no_restart=True)
        ray.shutdown()

    def rolling_restart(self, drain_grace_s: float = 60.0) -> None:
        """Each copy in turn: drain, let Ray start its actor again (maybe elsewhere), wait until routed to."""
        for p in list(self.workers):
            if p not in self.workers:
                continue
            old = p.urls[0] if p.urls else ""
            p.stop(drain_grace_s, restart=True)
            p.restarts += 1
            deadline = time.monotonic() + self.cfg.startup_timeout_s
            for u in [p.wait_info(deadline, other_than=old)["url"]]:
                self.wait_healthy(p, u + "/ready", deadline)  # type: ignore[arg-type]
            self._wait_router_sees_all(deadline)
        log.info("rolling restart done: %d actor(s)", len(self.workers))


def _wants(options: dict[str, Any]) -> str:
    keys = ("num_cpus", "num_gpus", "memory", "resources", "label_selector")
    return ", ".join(f"{k}={options[k]}" for k in keys if options.get(k))

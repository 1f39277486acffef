"""The fleet controller: each tick, every autoscaled model's copies are set to what its autoscaler wants.

It runs in the ``fleetllm serve`` process beside the launcher. Each tick it reads the router's state (which
workers are ready, their in-flight requests, the requests held for models with no ready copy), reads the
ready copies' ``/metrics``, asks each model's :class:`~fleetllm.fleet.autoscaler.Autoscaler`, reports the
decision to the router (which exports ``fleetllm_autoscaler_*`` and logs it) and acts:

- up: a new copy is placed and started; the router is told of it only once it answers ``/health`` (warm:
  the worker warms its engine before it listens), so no request meets a cold copy.
- down: the newest copy is drained first: the router stops sending it requests, the controller waits until
  its in-flight count reaches zero, and only then stops the process. No request fails for a scale-down.

Scale-ups and drains run in threads, so a copy that takes seconds to load never stalls the other models.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import asdict, replace
from typing import Any

import httpx

from fleetllm.fleet.autoscaler import Autoscaler, Decision
from fleetllm.fleet.config import ModelSpec
from fleetllm.fleet.launcher import Fleet, Proc
from fleetllm.fleet.placement import PlacementError
from fleetllm.fleet.signals import model_signals
from fleetllm.router.backends import fleetllm_spec

log = logging.getLogger(__name__)


class RouterAdmin:
    """The router's admin endpoints, as the controller uses them."""

    def __init__(self, url: str, admin_token: str | None = None) -> None:
        headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.client = httpx.Client(base_url=url, headers=headers, timeout=10.0)

    def state(self) -> dict[str, Any]:
        return self.client.get("/router/state").raise_for_status().json()

    def add_worker(self, url: str, zone: str, role: str, model: str, variant: str = "") -> None:
        self.client.post("/admin/workers", json={"url": fleetllm_spec(url), "zone": zone, "role": role, "model": model,
                                                 "variant": variant}).raise_for_status()

    def drain_worker(self, url: str) -> None:
        self.client.post("/admin/workers/drain", json={"url": url}).raise_for_status()

    def remove_worker(self, url: str) -> None:
        self.client.post("/admin/workers/remove", json={"url": url}).raise_for_status()

    def report(self, model: str, d: Decision) -> None:
        self.client.post("/admin/autoscaler", json={"model": model, **asdict(d)}).raise_for_status()


class FleetController:
    """Autoscales the fleet's models whose ``replicas.min < replicas.max``."""

    def __init__(self, fleet: Fleet, admin: RouterAdmin, interval_s: float = 2.0, drain_timeout_s: float = 120.0,
                 window_s: float = 15.0) -> None:
        self.fleet, self.admin = fleet, admin
        self.interval_s, self.drain_timeout_s = interval_s, drain_timeout_s
        self.models = {m.unit: m for m in fleet.cfg.models if m.autoscaled}
        self.scalers = {n: Autoscaler(m.autoscale, m.replicas.min, m.replicas.max) for n, m in self.models.items()}
        # the copy count each model is steered to: changes only with a decision, so copies still starting
        # (not yet ready, so not counted by the autoscaler) are not taken for a scale-down
        self.targets = {n: m.replicas.initial for n, m in self.models.items()}
        # each model's pages of the last ``window_s``: rates and percentiles are taken over the window, not
        # one tick (a 2 s tick sees a request of several seconds finish in one tick and none in the next)
        self.window_s = window_s
        self._pages: dict[str, deque[tuple[float, dict[str, str]]]] = {}
        self._draining: set[str] = set()  # names of worker processes being drained
        self._no_room: dict[str, str] = {}  # the last placement refusal per model

    def tick(self) -> dict[str, Decision]:
        """One round: signals -> decisions -> actions. Returns the decisions by model."""
        now = time.monotonic()
        state = self.admin.state()
        healthy = {w["url"] for w in state["workers"] if w.get("healthy") and not w.get("draining")}
        held = state.get("held", {})
        decisions = {}
        for name, m in self.models.items():
            procs = self.fleet.procs_of(m)
            ready = [u for p in procs for u in p.urls if u in healthy]
            if len(ready) < sum(len(p.urls) for p in procs if p.name not in self._draining):
                continue  # copies still starting: their load is not seen yet, so decide once they are ready
            pages = self._read(ready)
            past = self._pages.setdefault(name, deque())
            while len(past) > 1 and past[1][0] <= now - self.window_s:
                past.popleft()
            t_old, old = past[0] if past else (now, {})
            sig = model_signals(old, pages, now - t_old, held.get(m.served_name, 0))
            past.append((now, pages))
            d = decisions[name] = self.scalers[name].decide(sig)
            if d.direction != "none":
                self.targets[name] = d.desired
                log.info("autoscaler %s: %d -> %d copies (%s; %s)", name, sig.copies, d.desired, d.reason,
                         ", ".join(f"{k} {v:.2f}" for k, v in d.ratios.items()))
            self.admin.report(name, replace(d, desired=self.targets[name]))
            self._act(m, procs, self.targets[name])
        return decisions

    def _read(self, urls: list[str]) -> dict[str, str]:
        pages = {}
        for u in urls:
            try:
                r = httpx.get(u + "/metrics", headers=self.fleet.worker_headers, timeout=2.0)
                if r.status_code == 200:
                    pages[u] = r.text
            except httpx.HTTPError:
                pass  # a copy that cannot be read this tick counts next tick
        return pages

    def _act(self, m: ModelSpec, procs: list[Proc], desired: int) -> None:
        """Start or drain copies until ``desired`` are live (starting ones count; draining ones do not)."""
        live = [p for p in procs if p.name not in self._draining]
        for _ in range(desired - len(live)):
            try:
                proc = self.fleet.add_copy(m)  # placed and started now, so the next tick counts it
            except PlacementError as e:
                if self._no_room.get(m.unit) != str(e):  # said once, not every tick while it lasts
                    log.warning("autoscaler %s: cannot add a copy: %s", m.unit, e)
                self._no_room[m.unit] = str(e)
                return
            _thread(self._admit, proc)
        for proc in live[desired:] if desired < len(live) else []:  # the newest go first
            self._draining.add(proc.name)
            _thread(self._drain, proc)

    def _admit(self, proc: Proc) -> None:
        """Tell the router of a new copy once it is healthy (and so warm); remove it if it never is."""
        if self.fleet.discovers:
            return  # the router finds it itself once it answers (a Ray fleet)
        try:
            for u in proc.urls:
                self.fleet.wait_healthy(proc, u + "/ready", time.monotonic() + self.fleet.cfg.startup_timeout_s)
                m = proc.copies[0].model
                self.admin.add_worker(u, proc.zone, proc.role, m.served_name, m.variant or "")
        except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
            log.error("autoscaler: new copy %s failed: %s", proc.name, e)
            self.fleet.remove(proc)

    def _drain(self, proc: Proc) -> None:
        """No new requests to ``proc``; once its in-flight ones are done, stop it."""
        try:
            for u in proc.urls:
                self.admin.drain_worker(u)
            end = time.monotonic() + self.drain_timeout_s
            while time.monotonic() < end and self._inflight(proc.urls):
                time.sleep(0.2)
            if not self.fleet.discovers:  # a discovering router drops it once it is gone, and not before
                for u in proc.urls:
                    self.admin.remove_worker(u)
            self.fleet.remove(proc)
        except httpx.HTTPError as e:
            log.error("autoscaler: draining %s failed: %s", proc.name, e)
        finally:
            self._draining.discard(proc.name)

    def _inflight(self, urls: list[str]) -> int:
        return sum(w.get("inflight", 0) for w in self.admin.state()["workers"] if w["url"] in urls)


def _thread(fn: Any, arg: Any) -> None:
    threading.Thread(target=fn, args=(arg,), daemon=True, name=f"fleet{fn.__name__}").start()

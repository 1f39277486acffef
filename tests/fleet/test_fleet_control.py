"""A real `fleetllm serve` of several models: routing by model, API keys, scale from zero, autoscaling.

Simulated copies (no weights) keep most of these fast; one fleet of real workers (two models, speculation,
KV-aware routing, a clean stop) covers what only weights show. Processes, router, controller and HTTP are real.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from fleet_helpers import (
    ADMIN,
    ADMIN_TOKEN_FILE,
    TEST_KV_GB,
    free_ports,
    listening,
    stop_process,
    with_admin_token,
)
from prometheus_client.parser import text_string_to_metric_families

SIM = {"source": "smollm2-135m", "simulate": True, "engine": {"sim_speed": 20}}


class Serve:
    def __init__(self, cfg: dict, tmp: Path) -> None:
        self.port = cfg["port"] = free_ports(12)
        self.log_dir = tmp / "logs"
        cfg["log_dir"] = str(self.log_dir)
        (tmp / "fleet.yaml").write_text(yaml.safe_dump(cfg))
        fd, name = tempfile.mkstemp(prefix="fleetllm-serve-", suffix=".log")
        self.log_path = Path(name)
        argv = with_admin_token(["serve", "--config", str(tmp / "fleet.yaml")])
        self.popen = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", *argv],
                                      stdout=fd, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(fd)
        self.url = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + 120
        while "fleet ready" not in self.log():
            if self.popen.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError("serve did not start:\n" + self.log())
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logs(self) -> str:
        """Everything the fleet wrote: its own output and every worker's and the router's log."""
        return self.log() + "".join(p.read_text(errors="replace") for p in self.log_dir.glob("*.log"))

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
        stop_process(self.popen, timeout=60)


@pytest.fixture
def serve(tmp_path) -> Iterator:
    started: list[Serve] = []

    def start(cfg: dict) -> Serve:
        s = Serve(cfg, tmp_path)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
        s.log_path.unlink(missing_ok=True)


def complete(url: str, model: str, key: str | None = None, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hello there", "max_tokens": 4, **kw},
                      headers=headers, timeout=60)


def test_keys_gate_a_two_model_fleet_and_workers_answer_only_the_router(serve, tmp_path):
    from fleetllm.router.keys import KeyStore

    keys = KeyStore(tmp_path / "keys.yaml")
    rec, key = keys.create("team", models=["a"], rpm_limit=3)
    _, admin = keys.create("ops", admin=True)
    fleet = serve({"keys_file": str(tmp_path / "keys.yaml"), "policy": "round_robin",
                   "models": [{**SIM, "name": "a", "aliases": ["alpha"], "replicas": 2},
                              {**SIM, "name": "b", "replicas": 1}]})
    url = fleet.url
    assert f"admin token file: {ADMIN_TOKEN_FILE}" in fleet.log().splitlines()[:3]
    assert complete(url, "a").status_code == 401
    assert complete(url, "a", "flk-not-a-key").status_code == 401
    r = complete(url, "b", key)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    state = httpx.get(url + "/router/state", headers={"authorization": f"Bearer {admin}"}).json()
    a_workers = {w["name"] for w in state["workers"] if w["model"] == "a"}
    assert len(a_workers) == 2 and set(state["models"]) == {"a", "b"}
    served = {complete(url, m, key).headers["x-fleetllm-worker"] for m in ("a", "alpha")}
    assert served <= a_workers
    assert complete(url, "a", key).status_code == 200
    r = complete(url, "a", key)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1  # the 4th request within the minute
    # a worker called directly, without the router's secret, refuses
    direct = next(w["url"] for w in state["workers"])
    assert httpx.post(direct + "/v1/completions", json={"prompt": "x"}, headers={"authorization": f"Bearer {key}"}
                      ).status_code == 401
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers={"authorization": f"Bearer {key}"}).status_code == 403
    metrics = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {admin}"}).text
    assert f'fleetllm_key_requests_total{{key="{rec.id}",outcome="limited"}} 1.0' in metrics
    usage = httpx.get(url + "/admin/usage", headers={"authorization": f"Bearer {admin}"}).json()
    team = next(k for k in usage["keys"] if k["id"] == rec.id)
    assert team["requests"] == 3 and team["completion_tokens"] == 12
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).status_code == 401
    models = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"}).json()
    assert {m["id"] for m in models["data"]} == {"a", "b"}
    keys.revoke(rec.id)
    assert complete(url, "a", key).status_code == 401
    logs = fleet.logs() + metrics + str(usage) + str(state)
    assert key not in logs and admin not in logs and rec.hash not in logs


def test_a_model_scales_from_zero_for_a_held_request_and_back_to_zero_when_idle(serve):
    zero = {**SIM, "name": "z", "replicas": {"min": 0, "max": 1, "initial": 0},
            "autoscale": {"idle_s": 4, "cooldown_s": 1, "down_window_s": 2}}
    fleet = serve({"router_args": ["--hold-max-waiting", "1", "--hold-timeout", "60"],
                   "models": [{**SIM, "name": "a", "replicas": 1}, zero]})
    url = fleet.url

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=90) as c:
            first = asyncio.create_task(c.post(url + "/v1/completions", json={"model": "z", "prompt": "hi",
                                                                               "max_tokens": 3}))
            await asyncio.sleep(0.5)  # the first is held; the queue bound (1) is reached
            more = [await c.post(url + "/v1/completions", json={"model": "z", "prompt": "hi", "max_tokens": 3})
                    for _ in range(2)]
            return [await first, *more]

    held, *refused = asyncio.run(burst())
    assert held.status_code == 200, held.text
    assert int(held.headers["x-fleetllm-cold-start-ms"]) > 0
    assert all(r.status_code == 503 and r.headers["retry-after"] for r in refused)
    metrics = httpx.get(url + "/metrics", params={"federate": "0"}).text
    assert 'fleetllm_autoscaler_decisions_total{direction="up",model="z",reason="held"}' in metrics
    assert 'fleetllm_router_cold_start_seconds_count{model="z"} 1.0' in metrics
    # idle: drained and stopped, and the router forgets it
    end = time.monotonic() + 40
    while any(w["model"] == "z" for w in httpx.get(url + "/router/state", headers=ADMIN).json()["workers"]):
        assert time.monotonic() < end, fleet.log()
        time.sleep(0.5)
    metrics = httpx.get(url + "/metrics", params={"federate": "0"}).text
    assert 'fleetllm_autoscaler_desired_replicas{model="z"} 0.0' in metrics
    assert complete(url, "a").status_code == 200  # the other model never noticed


def _federated(url: str, name: str, label: str) -> dict[str, float]:
    """The router's /metrics samples called ``name`` (the workers' ones, federated), summed by ``label``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == name:
                out[s.labels[label]] = out.get(s.labels[label], 0) + s.value
    return out


@pytest.mark.slow
def test_a_real_fleet_of_smollm2_and_gemma3_routes_each_model_to_its_own_workers_and_stops_cleanly(serve):
    """Real workers: two SmolLM2 copies with n-gram speculation behind the KV-aware router, one Gemma 3."""
    fleet = serve({"policy": "kv_aware", "models": [
        # adaptive K off: on a loaded machine the measured step times may turn drafting off
        {"name": "smollm2", "source": "smollm2-135m", "replicas": 2, "speculative": "method=ngram,adaptive=0",
         "engine": {"num_threads": 1, "kv_cache_gb": TEST_KV_GB}},
        # no speculation: it would measure Gemma 3's step costs at start (~3 s of CPU), which no check here reads
        {"name": "gemma", "source": "gemma3-270m", "speculative": "none",
         "engine": {"num_threads": 1, "kv_cache_gb": TEST_KV_GB}}]})
    state = httpx.get(fleet.url + "/router/state", headers=ADMIN).json()
    workers = {m: {w["name"] for w in state["workers"] if w["model"] == m} for m in ("smollm2", "gemma")}
    assert (len(workers["smollm2"]), len(workers["gemma"])) == (2, 1)
    assert {m["id"] for m in httpx.get(fleet.url + "/v1/models").json()["data"]} == {"smollm2", "gemma"}
    for model in ("smollm2", "gemma", "gemma"):
        r = complete(fleet.url, model, prompt="The capital of France is", temperature=0)
        assert r.status_code == 200 and r.json()["model"] == model
        assert r.headers["x-fleetllm-worker"] in workers[model]
    assert complete(fleet.url, "llama").json()["error"]["message"].endswith("Served: gemma, smollm2")

    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none")
    messages = [{"role": "system", "content": "You are a terse assistant for a team of site reliability "
                 "engineers; answer in one short sentence with no preamble at all."},
                {"role": "user", "content": "What does a load balancer do?"}]
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip()
    again = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == text  # greedy, and routed to the worker that cached it
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    # the fleet's `speculative` reached the workers: a copying prompt gets n-gram drafts verified
    copy = "Repeat exactly: red green blue red green blue red green blue red green blue"
    client.completions.create(model="smollm2", prompt=copy, max_tokens=16, temperature=0)
    assert _federated(fleet.url, "vllm:spec_decode_num_drafts_total", "model_name")["smollm2"] > 0
    # the workers' series, federated by the router, carry their model
    assert _federated(fleet.url, "vllm:request_success_total", "model_name") == {"smollm2": 4, "gemma": 2}

    fleet.popen.send_signal(signal.SIGTERM)
    assert fleet.popen.wait(timeout=60) == 0
    assert not any(listening(u) for u in [fleet.url, *(w["url"] for w in state["workers"])]), fleet.logs()


def test_a_canary_gets_its_share_sticky_per_user_on_its_own_copies_and_is_promoted_at_run_time(serve):
    fleet = serve({"policy": "round_robin", "models": [
        {**SIM, "name": "m", "variant": "stable", "traffic": 80, "replicas": 2},
        {**SIM, "name": "m", "variant": "canary", "traffic": 20, "replicas": 1}]})
    url = fleet.url
    state = httpx.get(url + "/router/state", headers=ADMIN).json()
    copies = {v: {w["name"] for w in state["workers"] if w["variant"] == v} for v in ("stable", "canary")}
    assert len(copies["stable"]) == 2 and len(copies["canary"]) == 1
    assert state["traffic"] == {"m": {"stable": 80.0, "canary": 20.0}}

    async def send(users: list[str]) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*[c.post(url + "/v1/completions", json={
                "model": "m", "prompt": "hi", "max_tokens": 2, "user": u}) for u in users])

    users = [f"user-{i}" for i in range(200)]
    answers = asyncio.run(send(users))
    assert all(r.status_code == 200 for r in answers)
    chosen = {u: r.headers["x-fleetllm-variant"] for u, r in zip(users, answers, strict=True)}
    assert all(r.headers["x-fleetllm-worker"] in copies[chosen[u]] for u, r in zip(users, answers, strict=True))
    canary = sum(v == "canary" for v in chosen.values())
    assert 16 <= canary <= 64  # 20% of 200 = 40, sd 5.7: 4 sd either side
    again = asyncio.run(send(users[:40]))  # sticky: a user stays on its variant
    assert [r.headers["x-fleetllm-variant"] for r in again] == [chosen[u] for u in users[:40]]
    metrics = httpx.get(url + "/metrics", params={"federate": "0"}).text
    assert f'fleetllm_router_variant_requests_total{{model="m",variant="canary"}} {canary + sum(chosen[u] == "canary" for u in users[:40])}.0' in metrics
    assert 'fleetllm_router_variant_responses_total{model="m",status="200",variant="stable"}' in metrics
    # promote: every request to the canary, without a restart; a bad weight is refused by name
    bad = httpx.post(url + "/admin/traffic", json={"model": "m", "weights": {"canary": -1}}, headers=ADMIN)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "weights"
    assert httpx.post(url + "/admin/traffic", json={"model": "m", "weights": {"stable": 0, "canary": 1}},
                      headers=ADMIN).status_code == 200
    assert {r.headers["x-fleetllm-variant"] for r in asyncio.run(send(users[:20]))} == {"canary"}

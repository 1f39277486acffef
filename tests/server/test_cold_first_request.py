"""A fresh worker's first requests: nothing slow runs on its event loop.

Building the structured-output compiler imports torch and llguidance: 11 s on this 2-core host at load 15,
35 s at load 17. It used to happen on the event loop at a worker's first request of any kind (the compiler
was fetched to be handed to the thread that compiles), so a fresh copy answered no health check and no
other request meanwhile: in the Ray node-loss test the replacement copies' and the survivors' first requests
took 21-35 s (one past the client's 30 s timeout: the "lost" request), and the router, finding every copy
unhealthy, answered 503.
"""

from __future__ import annotations

import threading
from unittest import mock

import httpx
from fleet_helpers import sim_workers

from fleetllm.engine.engine import LLMEngine

CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def test_the_grammar_compiler_is_built_off_the_event_loop_and_only_for_a_constrained_request() -> None:
    built_on: list[str] = []
    real = LLMEngine.grammars

    def grammars(engine: LLMEngine):  # noqa: ANN202 - the real property's value
        built_on.append(threading.current_thread().name)
        return real.fget(engine)

    s = sim_workers(1)
    try:
        with mock.patch.object(LLMEngine, "grammars", property(grammars)):
            plain = httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=60)
            assert plain.status_code == 200, plain.text
            assert built_on == []  # an unconstrained request never needs the compiler
            constrained = httpx.post(s.url + "/v1/chat/completions", timeout=120,
                                     json={**CHAT, "response_format": {"type": "json_object"}})
            assert constrained.status_code == 200, constrained.text
    finally:
        s.stop()
    assert built_on and s.thread.name not in built_on  # that thread runs the worker's event loop

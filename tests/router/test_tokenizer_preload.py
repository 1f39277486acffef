"""A prefix-aware router loads its workers' models' tokenizers as it starts, not on their first request."""

from __future__ import annotations

import time

import pytest
from fleet_helpers import sim_workers, with_admin_token
from starlette.testclient import TestClient

from fleetllm.cli import build_parser, router_config
from fleetllm.router.gateway import Router


@pytest.mark.parametrize(("policy", "preloads"), [("kv_aware", True), ("least_load", False)])
def test_a_prefix_aware_router_has_its_models_tokenizer_before_any_request(policy, preloads):
    sims = sim_workers(1)
    try:
        args = build_parser().parse_args(with_admin_token(["router", "--workers", sims.urls[0], "--policy", policy]))
        r = Router(router_config(args))
        with TestClient(r.app):  # its lifespan: the worker's first health check, then the preload
            end = time.monotonic() + 10
            while preloads and not r.tokens.loaded("smollm2-135m") and time.monotonic() < end:
                time.sleep(0.02)
            assert r.tokens.loaded("smollm2-135m") is preloads
    finally:
        sims.stop()

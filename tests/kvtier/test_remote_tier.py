"""The shared Redis tier (--kv-remote): a block one engine wrote is loaded by another that never saw the prompt,
token-identical; a Redis that is not there costs hits (counted as errors), never a request."""

from __future__ import annotations

import socket

import pytest

from fleetllm.models.loader import LoadedModel
from tests.kvtier.tier_helpers import FULL_BLOCKS, close, engine_with, flush, metric, prompt, run


def test_a_prefix_computed_by_one_engine_is_loaded_by_another_through_redis(loaded_model: LoadedModel,
                                                                              redis_server) -> None:
    a, a_tiers = engine_with(loaded_model, remote=redis_server.url)
    b, b_tiers = engine_with(loaded_model, remote=redis_server.url)
    reference, first = run(a, prompt(23))
    flush(a_tiers)
    tokens, out = run(b, prompt(23))
    close(a_tiers + b_tiers)
    assert first.num_cached_tokens == 0
    assert out.num_cached_tokens == FULL_BLOCKS
    assert tokens == reference
    assert metric(b, 'fleetllm:kv_tier_hits_total{tier="remote"}') == FULL_BLOCKS // 16
    assert metric(a, 'fleetllm:kv_tier_bytes_total{direction="stored",tier="remote"}') > 0


def test_an_unreachable_redis_costs_hits_never_requests(loaded_model: LoadedModel, caplog) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"redis://:secret@127.0.0.1:{s.getsockname()[1]}"
    engine, tiers = engine_with(loaded_model, remote=dead)
    _, out = run(engine, prompt(31))  # run() asserts it finished without an error
    flush(tiers)
    close(tiers)
    assert metric(engine, 'fleetllm:kv_tier_errors_total{op="load",tier="remote"}') >= 1
    assert metric(engine, 'fleetllm:kv_tier_errors_total{op="store",tier="remote"}') >= 1
    assert out.num_cached_tokens == 0
    assert "secret" not in caplog.text and "KV tier" in caplog.text


def test_a_long_lookup_is_asked_in_chunks_and_a_chunk_that_fails_keeps_those_before_it(redis_server,
                                                                                      monkeypatch) -> None:
    from fleetllm.kvtier import remote

    monkeypatch.setattr(remote, "MGET_BLOCKS", 2)
    store = remote.RedisStore(redis_server.url, "chunks-test")
    for h in range(1, 6):
        store.put(h, b"block %d" % h)
    assert store.get_many([1, 2, 3, 4, 5, 99, 1]) == [b"block 1", b"block 2", b"block 3", b"block 4", b"block 5", None]
    calls = []
    real = store.client.mget

    def second_fails(keys):  # noqa: ANN001, ANN202
        calls.append(keys)
        if len(calls) == 2:
            raise ConnectionError("reset")
        return real(keys)

    monkeypatch.setattr(store.client, "mget", second_fails)
    assert store.get_many([1, 2, 3, 4]) == [b"block 1", b"block 2"]  # what came before the failure
    with pytest.raises(remote.Unavailable):  # and the back-off started: nothing asked for a while
        store.get_many([1, 2])
    store.client.delete(*[store.key(h) for h in range(1, 6)])
    store.close()

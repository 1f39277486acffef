"""A Responses follow-up turn (``previous_response_id``) reaches the worker holding its previous turn, and
is re-sent with its conversation inline when that worker is gone."""

from __future__ import annotations

import json

import httpx
import pytest
from fleet_helpers import ADMIN, router, sim_workers, wait_state

from fleetllm.router.sessions import ResponseSessions, Turn, resend_body
from fleetllm.server.protocol import APIError


# ---- the store ----------------------------------------------------------------------------------------
def test_a_turn_history_walks_its_parents_even_after_their_ids_are_evicted():
    s = ResponseSessions(capacity=2)
    a = Turn("w1", [{"type": "message", "role": "user", "content": "a"}])
    s.put("r1", a)
    s.put("r2", Turn("w1", [{"type": "message", "role": "user", "content": "b"}], a))
    s.put("r3", Turn("w1", [{"type": "message", "role": "user", "content": "c"}], s.get("r2")))
    assert len(s) == 2 and s.get("r1") is None
    assert [it["content"] for it in s.get("r3").history()] == ["a", "b", "c"]


def test_a_streamed_answer_is_recorded_from_its_completed_event_with_instructions_first():
    s = ResponseSessions()
    watch = s.watch({"input": "hi", "instructions": "be brief"})
    out = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]}
    done = json.dumps({"type": "response.completed", "response": {"id": "resp_1", "output": [out]}})
    for chunk in (b'data: {"type": "response.created"}\n\ndata: ', done.encode()[:20], done.encode()[20:] + b"\n\n"):
        watch.feed(chunk)
    watch.finish("w2", 200)
    turn = s.get("resp_1")
    assert turn.worker == "w2" and [it["role"] for it in turn.history()] == ["system", "user", "assistant"]


def test_unstored_and_failed_answers_are_not_recorded():
    s = ResponseSessions()
    assert s.watch({"input": "hi", "store": False}) is None
    watch = s.watch({"input": "hi"})
    watch.body(b'{"id": "resp_2", "output": []}')
    watch.finish("w1", 500)
    assert s.get("resp_2") is None


def test_a_resent_turn_carries_the_conversation_and_drops_the_previous_id():
    prev = Turn("w1", [{"type": "message", "role": "user", "content": "a"}])
    body = json.loads(resend_body({"previous_response_id": "r1", "instructions": "x", "input": "b", "model": "m"},
                                  prev))
    assert body == {"model": "m", "input": [{"type": "message", "role": "user", "content": "a"},
                                            {"type": "message", "role": "user", "content": "b"}]}


def _said(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def test_a_stored_turn_keeps_its_items_checked_and_normalised():
    s = ResponseSessions()
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    watch = s.watch({"input": [{"type": "message", "role": "user", "id": "m1", "content": parts}]})
    out = {"type": "message", "id": "x", "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": "c", "annotations": []}]}
    watch.body(json.dumps({"id": "resp_1", "output": [out]}).encode())
    watch.finish("w1", 200)
    assert s.get("resp_1").history() == [_said("ab"), {"type": "message", "role": "assistant", "content": "c"}]


@pytest.mark.parametrize("item", [{**_said("a"), "junk": 1}, {**_said("a"), "role": "wizard"},
                                  {"type": "message", "role": "user", "content": [{"type": "input_image"}]},
                                  {"type": "function_call", "name": "f", "arguments": "{}"}, _said("a" * 2**23)])
def test_a_malformed_or_oversized_input_item_is_a_400_and_nothing_is_stored(item):
    with pytest.raises(APIError) as e:
        ResponseSessions().watch({"input": [item]})
    assert e.value.status == 400 and e.value.param == "input"


def test_the_store_drops_the_least_recently_used_turns_past_its_characters():
    s = ResponseSessions(capacity=100, max_chars=250)
    for rid in ("r1", "r2", "r3"):
        s.put(rid, Turn("w1", [_said("a" * 100)]))  # 111 characters each: "message", "user" and the text
    assert s.get("r1") is None and s.get("r2") is not None and s.get("r3") is not None


def test_a_turn_is_found_only_with_the_key_that_stored_it():
    s = ResponseSessions()
    s.put("r1", Turn("w1", [_said("a")], owner="key-a"))
    assert s.get("r1", "key-b") is None and s.get("r1") is None and s.get("r1", "key-a") is not None


# ---- on a 2-worker fleet -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet():
    """Two simulated workers behind a round-robin router: without pinning, every other turn would land on
    the worker that does not hold the conversation."""
    import fleetllm.structured.compiler  # noqa: F401  (a worker's first chat request imports torch, as the session has)
    workers = sim_workers(2)
    r = router(workers.urls, "round_robin")
    try:
        wait_state(r.url, lambda st: all(w["healthy"] for w in st["workers"]))
        yield r, workers
    finally:
        r.stop()
        workers.stop()


def _turn(url: str, prev: str | None, text: str, stream: bool = False) -> tuple[str, str, dict]:
    """One turn: (response id, the worker that answered, usage)."""
    body = {"model": "smollm2-135m", "input": text, "max_output_tokens": 4, "stream": stream}
    if prev:
        body["previous_response_id"] = prev
    r = httpx.post(url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["id"], r.headers["x-fleetllm-worker"], r.json()["usage"]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    final = events[-1]["response"]
    return final["id"], r.headers["x-fleetllm-worker"], final["usage"]


def test_every_follow_up_turn_lands_on_the_worker_holding_the_session(fleet):
    r, _ = fleet
    rid, first, _ = _turn(r.url, None, "Hello there")
    for i in range(4):
        rid, worker, usage = _turn(r.url, rid, f"turn {i}", stream=i % 2 == 1)
        assert worker == first
        assert usage["input_tokens_details"]["cached_tokens"] > 0  # the worker reused the session's KV


def test_a_turn_whose_worker_is_gone_is_resent_with_its_conversation(fleet):
    r, workers = fleet
    rid, first, u1 = _turn(r.url, None, "Hello again")
    rid, _, u2 = _turn(r.url, rid, "one more")
    gone = next(u for u in workers.urls if u.endswith(first.split(":")[1]))
    httpx.post(r.url + "/admin/workers/drain", json={"url": gone}, headers=ADMIN, timeout=5).raise_for_status()
    _, worker, u3 = _turn(r.url, rid, "and now?")
    assert worker != first and u3["input_tokens"] > u2["input_tokens"] > u1["input_tokens"]


def test_routers_sharing_a_store_pin_each_others_follow_up_turns_to_the_worker_holding_the_session(fleet, redis_server):
    _, workers = fleet
    a, b = (router(workers.urls, "round_robin", "--state-url", redis_server.url) for _ in range(2))
    try:
        for r in (a, b):
            wait_state(r.url, lambda st: all(w["healthy"] for w in st["workers"]))
        rid, first, _ = _turn(a.url, None, "Hello through a")
        for i, via in enumerate([b, a, b]):  # each turn through a router that did not see the turn before it
            rid, worker, _ = _turn(via.url, rid, f"turn {i}")
            assert worker == first
    finally:
        a.stop()
        b.stop()

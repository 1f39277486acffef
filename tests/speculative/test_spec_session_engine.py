"""Session speculation in the engine: on by default, and a session's turns come out as they would without it."""

from __future__ import annotations

from fleetllm import LLM, SamplingParams
from fleetllm.engine.config import EngineConfig
from fleetllm.models.loader import LoadedModel
from fleetllm.speculative.config import SpeculativeConfig

TOOL = ('{"status": "failed", "tests": [{"id": "tests/test_cache.py::test_evict", "error": "AssertionError: 3 != 4"}, '
        '{"id": "tests/test_router.py::test_pin", "error": "KeyError: worker-2"}]}')


def session(llm: LLM, loaded: LoadedModel) -> list[list[int]]:
    """Two turns of an agent session, the second resending the first with its reply: each turn's tokens."""
    tok, greedy = loaded.tokenizer, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    msgs = [{"role": "user", "content": f"Tool output:\n{TOOL}\nRepeat the tool output exactly."}]
    outs = []
    for follow_up in ("Now quote the first error again, exactly.", None):
        out = llm.generate([tok.encode(tok.apply_chat_template(msgs))], greedy)[0].outputs[0]
        outs.append(out.token_ids)
        if follow_up:
            msgs += [{"role": "assistant", "content": out.text}, {"role": "user", "content": follow_up}]
    return outs


def test_a_sessions_greedy_turns_are_the_same_with_and_without_speculation(loaded_model: LoadedModel) -> None:
    plain = session(LLM(loaded=loaded_model, num_blocks=64, speculative=None), loaded_model)
    llm = LLM(loaded=loaded_model, num_blocks=64, speculative="method=suffix,k=4,adaptive=0")
    assert session(llm, loaded_model) == plain
    assert llm.engine.spec.num_accepted > 0
    kept = llm.engine.spec.drafter.sessions.idle
    assert len({id(s) for s in kept.values()}) == 1  # the second turn continued the first's stream


def test_the_default_is_suffix_drafting_with_adaptive_k_and_none_turns_it_off() -> None:
    cfg = SpeculativeConfig.parse(EngineConfig().speculative)
    assert (cfg.method, cfg.adaptive, cfg.k) == ("suffix", True, None)
    assert SpeculativeConfig.parse("none") is None


def test_a_seeded_sampled_request_answers_the_same_after_other_requests_filled_the_session_history(
        loaded_model: LoadedModel) -> None:
    llm = LLM(loaded=loaded_model, num_blocks=64, speculative="method=suffix,k=4,adaptive=0")
    tok = loaded_model.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat exactly:\n{TOOL}"}]))
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    first = llm.generate([ids], seeded)[0].outputs[0].token_ids
    drafted = llm.engine.spec.num_draft_tokens
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # history for the drafter
    assert llm.generate([ids], seeded)[0].outputs[0].token_ids == first
    assert llm.engine.spec.num_draft_tokens > drafted  # the greedy request drafted; the seeded ones did not need to

"""Drafters and the --speculative parser, without a model: what each drafter proposes and why."""

from __future__ import annotations

import numpy as np
import pytest

from fleetllm.engine.sampling import SamplingParams
from fleetllm.engine.sequence import Sequence
from fleetllm.speculative.config import SpeculativeConfig
from fleetllm.speculative.drafter import create_drafter
from fleetllm.speculative.ngram import lookup


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), max_tokens=16)


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_match() -> None:
    toks = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    assert lookup(toks, k=2) == [5, 7]  # the later of the two earlier "1 2 3"


def test_prompt_lookup_prefers_the_longest_suffix() -> None:
    toks = np.array([8, 2, 3, 6, 6, 1, 2, 3, 4, 0, 5, 1, 2, 3])
    # "2 3" last occurs before 4, but the longer "1 2 3" also matches there; both give 4
    assert lookup(toks, k=3, max_n=3) == [4, 0, 5]


def test_prompt_lookup_without_a_match_drafts_nothing() -> None:
    assert lookup(np.array([1, 2, 3, 4, 5]), k=4) == []


def test_ngram_drafter_respects_k_per_sequence() -> None:
    d = create_drafter("ngram")
    a, b = seq([5, 6, 7, 8, 5, 6], "a"), seq([1, 2, 3, 1, 2], "b")
    assert d.propose([a, b], [1, 0]) == [[7], []]


def test_suffix_drafter_drafts_longer_after_a_longer_match() -> None:
    d = create_drafter("suffix")
    short = seq([9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2], "short")  # suffix "1 2" matches 2 tokens
    long_ = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5], "long")  # suffix "1 2 3 4 5" matches 5
    short_draft, long_draft = d.propose([short, long_], [8, 8])
    assert short_draft == [3]
    assert long_draft == [6, 7, 8, 9]


def test_suffix_drafter_indexes_new_tokens_incrementally() -> None:
    d = create_drafter("suffix")
    s = seq([4, 5, 6, 7], "inc")
    assert d.propose([s], [4]) == [[]]
    s.output_token_ids += [4, 5, 6]
    assert d.propose([s], [4]) == [[7, 4]]  # "4 5 6" matched: 2 tokens


def test_suffix_drafter_forgets_a_finished_request() -> None:
    d = create_drafter("suffix")
    s = seq([1, 2, 1, 2], "gone")
    d.propose([s], [2])
    s.status = s.status.FINISHED_STOPPED
    d.forget(s)
    assert "gone" not in d.sessions.live


def test_unknown_method_names_the_choices() -> None:
    with pytest.raises(ValueError, match="ngram"):
        create_drafter("medusa")


@pytest.mark.parametrize(
    ("text", "method", "k", "adaptive"),
    [("method=peagle,k=4", "peagle", 4, True), ("ngram", "ngram", None, True), ("method=suffix,k=3,adaptive=0", "suffix", 3, False)],
)
def test_speculative_flag_parses(text: str, method: str, k: int | None, adaptive: bool) -> None:
    cfg = SpeculativeConfig.parse(text)
    assert (cfg.method, cfg.k, cfg.adaptive) == (method, k, adaptive)


@pytest.mark.parametrize("text", ["", "none", None])
def test_speculative_off(text: str | None) -> None:
    assert SpeculativeConfig.parse(text) is None


def test_speculative_flag_rejects_unknown_keys_and_bad_k() -> None:
    with pytest.raises(ValueError, match="unknown"):
        SpeculativeConfig.parse("method=ngram,depth=3")
    with pytest.raises(ValueError, match="k must be"):
        SpeculativeConfig.parse("method=ngram,k=0")


def test_the_session_memory_is_a_key_of_the_flag() -> None:
    assert SpeculativeConfig.parse("method=suffix,session_tokens=0").session_tokens == 0
    with pytest.raises(ValueError, match="session_tokens must be"):
        SpeculativeConfig.parse("method=suffix,session_tokens=-1")

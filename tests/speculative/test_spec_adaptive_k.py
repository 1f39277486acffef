"""How K is chosen: from acceptance and the measured cost of a (1+K)-token step, backing off to 0."""

from __future__ import annotations

from fleetllm.speculative.config import SpeculativeConfig
from fleetllm.speculative.decoder import MIN_GAIN, PROBE_EVERY, RequestSpecState, SpecDecoder


def decoder(cost) -> SpecDecoder:  # type: ignore[no-untyped-def]
    dec = SpecDecoder(SpeculativeConfig(method="ngram", k=4, adaptive=False), loaded=None, kv_cache=None)
    dec.cfg.adaptive = True
    dec.cost = cost
    return dec


def test_when_a_verify_costs_as_much_as_its_tokens_k_is_zero() -> None:
    assert decoder(lambda n: float(n))._best_k(0.9, 1) == 0


def test_when_a_verify_is_nearly_free_and_drafts_are_accepted_k_is_the_maximum() -> None:
    assert decoder(lambda n: 1.0 + 0.02 * n)._best_k(0.8, 1) == 4


def test_poor_acceptance_turns_speculation_off() -> None:
    assert decoder(lambda n: 1.0 + 0.2 * n)._best_k(0.1, 1) == 0


def test_a_thin_expected_gain_is_not_worth_speculating() -> None:
    free = decoder(lambda n: 1.0)  # even with free verifies, 5% more tokens per step does not pay for the overheads
    assert (1 - 0.05**5) / (1 - 0.05) < MIN_GAIN
    assert free._best_k(0.05, 1) == 0
    assert free._best_k(0.2, 1) > 0  # 25% more tokens per step does


def test_larger_batches_get_smaller_k_when_steps_become_compute_bound() -> None:
    dec = decoder(lambda n: max(1.0, n / 8))  # flat up to 8 tokens, then linear
    assert dec._best_k(0.7, 1) > dec._best_k(0.7, 4) >= dec._best_k(0.7, 16) == 0


def test_a_request_whose_drafts_keep_failing_backs_off_then_probes() -> None:
    dec = decoder(lambda n: 1.0 + 0.1 * n)
    st = RequestSpecState()
    assert dec._choose_k(st, 1) > 0
    for _ in range(10):
        st.update(4, 0)
    ks = [dec._choose_k(st, 1) for _ in range(PROBE_EVERY)]
    assert ks[:-1] == [0] * (PROBE_EVERY - 1)
    assert ks[-1] > 0  # a probe, so the request can win speculation back

"""Per-token mask cost of llguidance vs xgrammar on the served model's vocabulary (49,152 for SmolLM2).

For one JSON schema, each engine compiles the grammar (cold, then from its cache) and then decodes a
valid JSON document token by token: compute the next-token bitmask, consume the token. Reported: compile
ms, and the mean / p99 microseconds per token of mask + consume. The winner backs :mod:`fleetllm.structured`.

    python benchmarks/grammar_mask_cost.py [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry", "engines"],
       "address": {"city": "London", "zip": "W1"}, "active": True}


def _stats(times: list[float]) -> str:
    times = sorted(times)
    return f"mean {statistics.mean(times) * 1e6:.1f} us, p99 {times[int(len(times) * 0.99)] * 1e6:.1f} us"


def bench_llguidance(tok_json: str, eos: int, ids: list[int], vocab: int) -> None:
    import llguidance
    import llguidance.torch as lgt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    t_tok = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, grammar)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, grammar)
    t_warm = time.perf_counter() - t0
    mask = lgt.allocate_token_bitmask(1, vocab)
    first = _decode_llg(m, mask, ids)
    times = _decode_llg(llguidance.LLMatcher(lltok, grammar), mask, ids)  # a second request, same grammar
    print(f"llguidance {llguidance.__version__}: tokenizer {t_tok * 1e3:.0f} ms, matcher cold {t_cold * 1e3:.1f} ms, "
          f"again {t_warm * 1e3:.1f} ms; per token first request {_stats(first)}, next request {_stats(times)} "
          f"over {len(ids)} tokens")


def _per_token(ids: list[int], step) -> list[float]:  # noqa: ANN001 - step(token) -> error or None
    """Seconds of each ``step`` (fill the next-token mask, then take the token) over ``ids``."""
    times = []
    for t in ids:
        t0 = time.perf_counter()
        error = step(t)
        times.append(time.perf_counter() - t0)
        assert error is None, error
    return times


def _decode_llg(m, mask, ids: list[int]) -> list[float]:
    import llguidance.torch as lgt

    def step(t: int) -> str | None:
        lgt.fill_next_token_bitmask(m, mask, 0)
        return None if m.consume_token(t) else m.get_error()

    return _per_token(ids, step)


def bench_xgrammar(tok_json: str, eos: int, ids: list[int], vocab: int) -> None:
    import xgrammar as xg
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    tk = Tokenizer.from_str(tok_json)
    encoded = [tk.id_to_token(i) or "" for i in range(vocab)]
    info = xg.TokenizerInfo(encoded, vocab_type=xg.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xg.GrammarCompiler(info, max_threads=2)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    t_warm = time.perf_counter() - t0
    mask = xg.allocate_token_bitmask(1, vocab)
    first = _decode_xg(xg.GrammarMatcher(cg), mask, ids)
    times = _decode_xg(xg.GrammarMatcher(cg), mask, ids)
    print(f"xgrammar {xg.__version__ if hasattr(xg, '__version__') else ''}: tokenizer info {t_tok * 1e3:.0f} ms, "
          f"compile cold {t_cold * 1e3:.1f} ms, cached {t_warm * 1e3:.1f} ms; per token first request "
          f"{_stats(first)}, next request {_stats(times)} over {len(ids)} tokens")


def _decode_xg(m, mask, ids: list[int]) -> list[float]:
    def step(t: int) -> str | None:
        m.fill_next_token_bitmask(mask, 0)
        return None if m.accept_token(t) else f"token {t} refused"

    return _per_token(ids, step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    from fleetllm.models.loader import load_model

    tok = load_model(args.model).tokenizer
    vocab = tok.vocab_size
    ids = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False) + [tok.eos_token_id]
    print(f"model {args.model}: vocabulary {vocab}, document {len(ids)} tokens")
    tok_json = tok.tok.to_str()
    bench_llguidance(tok_json, tok.eos_token_id, ids, vocab)
    bench_xgrammar(tok_json, tok.eos_token_id, ids, vocab)


if __name__ == "__main__":
    main()

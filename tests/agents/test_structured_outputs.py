"""Structured outputs through the official openai client: response_format (json_schema, json_object) and
vLLM's structured_outputs / guided_* fields, with n > 1, streaming, prefix caching and ngram speculation."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
TOPICS = ["a pirate", "a chef", "a child", "a robot", "a queen", "a farmer", "a poet", "a doctor", "a pilot", "a cat"]
STYLES = ["Describe", "Invent", "Give me", "Make up", "Create"]
PROMPTS = [f"{s} {t} as JSON with name, age and mood." for s in STYLES for t in TOPICS]  # 50 varied prompts


@pytest.fixture(scope="module")
def client(worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.openai_base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def spec_worker(worker_factory):
    return worker_factory("--speculative", "method=ngram,k=4,adaptive=0")


def _ask(client: openai.OpenAI, prompt: str, stream: bool, **kw) -> list[str]:
    """The texts of every choice of one request."""
    args = dict(model="smollm2-135m", messages=[{"role": "user", "content": prompt}], max_tokens=32,
                temperature=0.8, response_format=RESPONSE_FORMAT, **kw)
    if not stream:
        return [c.message.content for c in client.chat.completions.create(**args).choices]
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return [texts[i] for i in sorted(texts)]


def test_json_schema_outputs_all_validate_over_50_prompts_streamed_and_not_with_n_2(client):
    jobs = [(p, i % 3 == 0, 2 if i % 5 == 0 else 1) for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: one batch decodes them
        results = list(pool.map(lambda j: _ask(client, j[0], j[1], n=j[2], seed=len(j[0])), jobs))
    texts = [t for r in results for t in r]
    assert len(texts) == sum(n for _, _, n in jobs) == 60
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_gives_a_json_object(client):
    r = client.chat.completions.create(model="smollm2-135m", max_tokens=30, temperature=0.0,
                                       messages=[{"role": "user", "content": "A JSON object with key a and value 1"}],
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit()),
    ({"guided_regex": "(cat|dog)s?"}, lambda t: t.rstrip("s") in ("cat", "dog")),
    ({"guided_grammar": 'start: "ab" ("c" | "d")'}, lambda t: t in ("abc", "abd")),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9]'}}, lambda t: len(t) == 2 and t[0] == "x"),
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
     lambda t: all(isinstance(v, bool) for v in json.loads(t))),
])
def test_vllm_constraint_fields_are_enforced(client, extra, check):
    r = client.chat.completions.create(model="smollm2-135m", max_tokens=12, temperature=1.0, seed=3,
                                       messages=[{"role": "user", "content": "Answer."}], extra_body=extra)
    assert check(r.choices[0].message.content), r.choices[0].message.content


def test_completions_accept_constraints_too(client):
    r = client.completions.create(model="smollm2-135m", prompt="The answer is", max_tokens=6,
                                  extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta")


@pytest.mark.parametrize("extra, field, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs", "missing_rule"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "at most one"),
])
def test_an_invalid_constraint_is_a_400_naming_the_problem(client, extra, field, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", max_tokens=4, extra_body=extra,
                                       messages=[{"role": "user", "content": "hi"}])
    err = e.value.body
    assert err["param"] == field and words in err["message"], err


def test_greedy_output_is_identical_with_and_without_ngram_speculation(client, spec_worker):
    spec_client = openai.OpenAI(base_url=spec_worker.openai_base_url, api_key="x", max_retries=0)
    # a repetitive prompt: the ngram drafter finds matches, and drafts pass through the grammar check
    prompt = "Repeat exactly: {\"name\": \"Bob\", \"age\": 7, \"mood\": \"calm\"} {\"name\": \"Bob\", \"age\": 7"
    texts = [c.chat.completions.create(model="smollm2-135m", max_tokens=40, temperature=0.0,
                                       response_format=RESPONSE_FORMAT,
                                       messages=[{"role": "user", "content": prompt}]).choices[0].message.content
             for c in (client, spec_client)]
    assert texts[0] == texts[1]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert spec_worker.metrics()["vllm:spec_decode_num_accepted_tokens_total"] > 0  # drafts passed the grammar


def test_a_prefix_cache_hit_gives_the_same_constrained_output(client):
    prompt = "A person as JSON. " + "Context words to fill a few blocks of the prefix cache. " * 6
    first, again = (client.chat.completions.create(model="smollm2-135m", max_tokens=40, temperature=0.0,
                                                   response_format=RESPONSE_FORMAT,
                                                   messages=[{"role": "user", "content": prompt}]) for _ in range(2))
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].message.content == again.choices[0].message.content

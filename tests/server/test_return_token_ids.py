"""vLLM's ``return_token_ids``: a completion's choices carry the prompt's and the output's token ids."""

from __future__ import annotations

import json

import httpx

BODY = {"model": "smollm2-135m", "prompt": [[1, 504, 3458], [1, 2075]], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}


def test_choices_carry_prompt_and_output_token_ids(worker) -> None:
    r = httpx.post(worker.openai_base_url + "/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["prompt_token_ids"] == BODY["prompt"][c["index"]]
        assert len(c["token_ids"]) == 6
        assert worker.worker.engine.tokenizer.decode(c["token_ids"]) == c["text"]


def test_a_stream_carries_each_chunks_token_ids(worker) -> None:
    whole = httpx.post(worker.openai_base_url + "/completions", json=BODY, timeout=60).json()["choices"]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    prompts: dict[int, list[int]] = {}
    with httpx.stream("POST", worker.openai_base_url + "/completions", json={**BODY, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] += c["token_ids"]
                    prompts.setdefault(c["index"], c.get("prompt_token_ids"))
    assert streamed == {c["index"]: c["token_ids"] for c in whole}
    assert prompts == {0: BODY["prompt"][0], 1: BODY["prompt"][1]}


def test_return_token_ids_must_be_a_boolean(worker) -> None:
    r = httpx.post(worker.openai_base_url + "/completions", json={**BODY, "return_token_ids": "yes"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids"

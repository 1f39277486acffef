"""P/D with adapters: a frame carries its adapter, is imported under that adapter's block keys, and serves only
requests of that adapter on the decode side; a prompt prefilled with an adapter and handed over decodes as it."""

from __future__ import annotations

from dataclasses import replace

from fleetllm.disagg import frame
from fleetllm.disagg.kv_io import export_blocks, import_blocks
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling import SamplingParams

PROMPT = [1, *range(200, 240)]  # two full blocks and some
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_an_adapters_kv_moved_between_engines_serves_that_adapter_only(tiny_lora) -> None:
    a, b = (LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, num_blocks=64) for _ in range(2))
    for llm in (a, b):
        llm.load_lora("qv4", str(tiny_lora.dirs["qv4"]))
    local = a.generate([PROMPT], PARAMS, lora_name="qv4")[0].outputs[0].token_ids
    header, layers = export_blocks(a.engine, PROMPT, lora_name="qv4")
    moved = frame.decode(b"".join(frame.encode(header, layers)))
    assert moved[0].lora_name == "qv4" and import_blocks(b.engine, *moved)["imported"] == 2
    base = b.generate([PROMPT], PARAMS)[0]
    remote = b.generate([PROMPT], PARAMS, lora_name="qv4")[0]
    assert (base.num_cached_tokens, remote.num_cached_tokens) == (0, 32)
    assert remote.outputs[0].token_ids == local


def test_a_prompt_prefilled_with_an_adapter_and_handed_over_decodes_as_that_adapter(tiny_lora) -> None:
    from fleetllm.disagg.connector import pd_connector
    from fleetllm.disagg.kv_io import commit_held, frame_header, reserve, write
    from fleetllm.disagg.layer_stream import LayerStream
    from fleetllm.engine.block_pool import hash_prefix_blocks
    from fleetllm.engine.handoff import Handoff

    a, b = (LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, num_blocks=64).engine
            for _ in range(2))
    for engine in (a, b):
        engine.load_lora("qv4", str(tiny_lora.dirs["qv4"]))
    ids = PROMPT[:37]  # a partial last block
    header = frame_header(a, ids, hash_prefix_blocks(ids, 16, a.kv.key_of("qv4")), tail=True, lora_name="qv4")
    fb = frame.FrameBuffer(header, bytearray(header.frame_bytes()))
    stream = LayerStream(fb)
    pd_connector(a).observe("p", stream)
    a.add_request("p", ids, replace(PARAMS, max_tokens=1), lora_name="qv4")  # the prefill and its one token
    first = []
    while a.has_unfinished():
        first += [t for o in a.step() for t in o.new_token_ids]
    stream.done.result(timeout=30)
    pd_connector(a).observe("p", None)
    stream.close()
    header, layers = frame.decode(bytes(fb.mv))
    res = reserve(b, header)
    write(b.kv_blocks(), layers, res)
    _, table = commit_held(b, res)
    b.add_request("d", ids, PARAMS, handoff=Handoff(ids, table, header.block_hashes, first[0], lora_name="qv4"),
                  lora_name="qv4")
    toks = [t for o in b.take_outputs() for t in o.new_token_ids]
    while b.has_unfinished():
        toks += [t for o in b.step() for t in o.new_token_ids]
    assert toks == tiny_lora.greedy("qv4", ids, PARAMS.max_tokens)
    assert b.lora.resident() == {"qv4": 0} and b.pool.num_free == b.pool.num_blocks  # slot and blocks let go


def test_an_adapters_request_prefilled_on_a_prefill_worker_answers_the_colocated_tokens(worker_factory,
                                                                                         tmp_path) -> None:
    import httpx
    from lora_models import write_adapter

    from fleetllm.disagg.handoffs import HEADER

    # q and v of SmolLM2-135M's 30 layers, large enough to change its greedy tokens (what shows the prefill used it)
    a1 = write_adapter(tmp_path / "a1", {"q_proj": (576, 576), "v_proj": (576, 192)}, 30, ["q_proj", "v_proj"], 8, 16,
                       seed=3, scale=0.1)
    # a prompt computed whole or handed over: the same arithmetic (batch-invariant), and an fp32 pool, so that the
    # handed-over K/V are what the colocated worker's prompt attends over (a bf16 pool's would be rounded)
    lora = ("--enable-lora", "--lora-modules", f"a1={a1}", "--batch-invariant", "--kv-cache-dtype", "fp32")
    prefill, decode, colocated = (worker_factory(*role, *lora) for role in (("--role", "prefill"),
                                                                            ("--role", "decode"), ()))
    ids = [(i * 104729) % 40000 + 100 for i in range(3 * 16 + 5)]
    body = {"model": "a1", "prompt": ids, "max_tokens": 8, "temperature": 0}
    r = httpx.post(prefill.url + "/pd/prefill", json={"path": "/v1/completions", "body": body,
                                                      "decode_url": decode.url, "transfer": "shm"}, timeout=120)
    assert r.status_code == 200, r.text
    remote = httpx.post(decode.url + "/v1/completions", json=body, headers={HEADER: r.json()["handoff"]}, timeout=120)
    local = httpx.post(colocated.url + "/v1/completions", json=body, timeout=120)
    assert remote.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids)  # handed over, not redone
    assert remote.json()["choices"][0]["text"] == local.json()["choices"][0]["text"]
    base = httpx.post(colocated.url + "/v1/completions", json={**body, "model": "smollm2-135m"}, timeout=120)
    assert base.json()["choices"][0]["text"] != local.json()["choices"][0]["text"]  # the adapter's own tokens
    kv = decode.worker.engine.kv  # the handed-over prompt's full blocks are cached as the adapter's, not the base's
    assert (len(kv.cached_prefix(ids, "a1")[0]), len(kv.cached_prefix(ids)[0])) == (3, 0)

"""The hardware catalogue and model shapes: the data the recommender reasons from."""

from __future__ import annotations

import json

import pytest

from fleetllm.recommend.catalogue import load_catalogue
from fleetllm.recommend.model_shape import CATALOGUE, from_hf_config, load_shape


def test_the_shipped_catalogue_has_every_required_instance_with_a_dated_sourced_price() -> None:
    cat = load_catalogue()
    accelerators = {i.accelerator for i in cat.instances}
    assert {"A10G", "L4", "L40S", "RTX PRO 6000 Blackwell", "H100 SXM", "H200", "B200", "cpu"} <= accelerators
    assert sorted(i.count for i in cat.instances if i.accelerator == "RTX PRO 6000 Blackwell") == [1, 2, 4, 8]
    for i in cat.instances:
        assert i.price_per_hour > 0 and i.price_date and i.price_source, i.name
        assert i.memory_gb > 0 and i.bandwidth_gbs > 0 and i.tflops, i.name
    assert cat.instance("p6-b200.48xlarge").runs_natively("fp4")
    assert cat.instance("g5.xlarge").peak_tflops("fp8") == cat.instance("g5.xlarge").tflops["bf16"]  # next wider


def test_a_catalogue_with_an_unknown_key_is_refused_by_name(tmp_path) -> None:
    p = tmp_path / "hw.yaml"
    p.write_text("instances:\n  - {name: x, accelerator: A, count: 1, memory_gb: 1, bandwidth_gbs: 1, tflops: {bf16: 1},"
                 " interconnect_gbs: 0, network_gbps: 0, price_per_hour: 1, price_date: d, price_source: s, colour: red}\n")
    with pytest.raises(ValueError, match="colour"):
        load_catalogue(p)


def test_catalogue_shapes_have_their_published_parameter_counts() -> None:
    assert CATALOGUE["llama-3.1-8b"].params == pytest.approx(8.03e9, rel=0.01)
    assert CATALOGUE["llama-3.1-70b"].params == pytest.approx(70.6e9, rel=0.01)
    assert CATALOGUE["smollm2-135m"].params == pytest.approx(134.5e6, rel=0.01)
    moe = CATALOGUE["qwen3-30b-a3b"]
    assert moe.params == pytest.approx(30.5e9, rel=0.02) and moe.active_params < moe.params / 8


def test_a_dense_config_json_is_read_through_fleetllms_own_reader(tmp_path) -> None:
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = load_shape(str(tmp_path))
    assert shape.params == CATALOGUE["llama-3.1-8b"].params and shape.runs_here == str(tmp_path)


def test_a_moe_config_json_gives_active_parameters() -> None:
    d = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
         "num_experts_per_tok": 2}
    shape = from_hf_config("mixtral", d)
    assert shape.params == pytest.approx(46.7e9, rel=0.02)
    assert shape.active_params == pytest.approx(12.9e9, rel=0.03)


def test_a_qwen3_moe_config_json_is_read_through_fleetllms_own_reader(tmp_path) -> None:
    """A family the engine runs: its shape comes from the loader's reader, equal to the catalogue's 30B-A3B."""
    d = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
         "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
         "max_position_embeddings": 40960}
    (tmp_path / "config.json").write_text(json.dumps(d))
    shape, ref = load_shape(str(tmp_path)), CATALOGUE["qwen3-30b-a3b"]
    assert shape.runs_here == str(tmp_path)
    assert (shape.params, shape.active_params) == (ref.params, ref.active_params)


def test_an_unknown_model_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        load_shape("no-such-model")


def test_a_capture_directory_gives_real_lengths_and_shared_system_prompts(tmp_path) -> None:
    from fleetllm.capture.records import endpoint_record, payload
    from fleetllm.recommend.workload import load_workload

    system = "You are a careful assistant. " * 40
    lines = []
    for i in range(6):
        body = {"model": "m", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": f"question {i} " * 10}]}
        out = {"usage": {"prompt_tokens": 300, "completion_tokens": 20 + i}}
        lines.append(json.dumps(endpoint_record(f"r{i}", 1.7e9 + i, payload(json.dumps(body), "application/json", "INPUT"),
                                                payload(json.dumps(out), "application/json", "OUTPUT"), {"status": 200})))
    (tmp_path / "part-0.jsonl").write_text("\n".join(lines) + "\n")
    w = load_workload(str(tmp_path))
    assert len(w.isl) == 6 and list(w.osl) == [20, 21, 22, 23, 24, 25]
    assert 0.5 < w.shared_prefix < 1.0  # the system prompt is most of each prompt, and all share it

"""The recommender's roofline against published serving figures on H100 and H200.

Two kinds of published point, each predicted with the catalogue's figures and the default vLLM-like
efficiency (nothing here is fitted to them):

- **closed loop at a stated concurrency** (NVIDIA NIM's AIPerf tables): ``c`` users each send the next
  request when the last one ends; predicted with the analytic model at the rate such a loop produces
  (rate = c / E2E, iterated);
- **maximum throughput** (TensorRT-LLM's ``trtllm-bench throughput``: every request queued at once, the
  batch is as many requests as the KV cache holds): predicted as the highest request rate the analytic
  model still serves (utilisation < 1) times OSL.

Both NVIDIA stacks keep an FP8 KV cache with FP8 weights, which their own figures show: NIM's
Llama-3.3-70B on 2×H100 runs ~86 requests of 5000+500 tokens at once at saturation (920 tok/s at an ITL
of 93 ms), which a bf16 KV cache could not hold next to 35 GB of weights per GPU. The predictions use
``kv_cache_bytes=1``; the bf16-KV prediction (vLLM's default) is printed alongside to show how much of
each figure the KV capacity decides. Sources and dates are in docs/recommend.md.

    PYTHONPATH=. python benchmarks/recommender_sanity.py
"""

from __future__ import annotations

from fleetllm.recommend.candidate import Candidate
from fleetllm.recommend.catalogue import load_catalogue
from fleetllm.recommend.model_shape import CATALOGUE
from fleetllm.recommend.perf_model import Efficiency, Roofline
from fleetllm.recommend.queueing import capacity, predict
from fleetllm.recommend.workload import from_distribution

NIM = "NIM 1.8.0"  # docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance (page updated 2026-07-20)
TRT = "TRT-LLM 1.0"  # TensorRT-LLM docs/source/performance/perf-overview.md (v1.0 tables)
H100, H200 = "p5.48xlarge", "p5e.48xlarge"
# closed loop: (source, model, instance, tp, isl, osl, concurrency, published ITL ms, published output tok/s)
CLOSED = [
    (NIM, "llama-3.1-70b", H100, 2, 5000, 500, 1, 18.58, 51.67),
    (NIM, "llama-3.1-70b", H100, 2, 5000, 500, 5, 21.83, 218.48),
    (NIM, "llama-3.1-70b", H100, 2, 5000, 500, 25, 38.75, 623.4),
    (NIM, "llama-3.1-70b", H100, 2, 5000, 500, 50, 59.73, 814.37),
    (NIM, "llama-3.1-70b", H100, 2, 5000, 500, 100, 92.91, 917.26),
    (NIM, "llama-3.1-70b", H100, 2, 500, 2000, 1, 18.91, 52.85),
]
# maximum throughput: (source, model, instance, tp, isl, osl, published output tok/s)
SATURATED = [
    (TRT, model, inst, tp, isl, osl, tps)
    for model, inst, tp, row in [
        ("llama-3.1-8b", H100, 1, (22714, 17660, 15220, 9305, 3459, 3450)),
        ("llama-3.1-8b", H200, 1, (26221, 20770, 17744, 12194, 3902, 3538)),
        ("llama-3.1-70b", H100, 2, (6651, 5222, 4205, 3082, 898, 762)),
        ("llama-3.1-70b", H200, 1, (4336, 3666, 2909, 2003, 566, 442)),
    ]
    for (isl, osl), tps in zip([(128, 2048), (500, 2000), (1000, 1000), (2048, 2048), (5000, 500), (2048, 128)], row, strict=True)
]
FP8_KV, BF16_KV = Efficiency(kv_cache_bytes=1.0), Efficiency(kv_cache_bytes=2.0)
CAT = load_catalogue()


def _setup(model: str, inst: str, tp: int, eff: Efficiency) -> tuple[Roofline, Candidate]:
    step = Roofline(CATALOGUE[model], CAT.instance(inst), CAT.formats["fp8"], tp, eff)
    # batch and chunk as the engines' defaults allow (TRT-LLM: max_num_tokens 8192); the KV cache binds first
    return step, Candidate(CAT.instance(inst), tp, CAT.formats["fp8"], 1, 2048, 8192)


def closed_loop(model: str, inst: str, tp: int, isl: int, osl: int, users: int, eff: Efficiency) -> tuple[float, float]:
    """(ITL ms, output tok/s) predicted for ``users`` in a closed loop."""
    step, c = _setup(model, inst, tp, eff)
    w = from_distribution(f"isl={isl},osl={osl}")
    kv = step.kv_capacity_tokens()
    top = capacity(c, step, w, kv, {}, 1.0) * 0.999  # a closed loop never offers more than the fleet finishes
    rate = min(top, users / (osl * 0.02))
    for _ in range(40):
        p = predict(c, step, w, rate, kv)
        cycle = p.ttft_p50_ms / 1e3 + osl * p.itl_p50_ms / 1e3
        rate = min(top, 0.5 * rate + 0.5 * users / cycle)
    return p.itl_p50_ms, rate * osl


def saturated(model: str, inst: str, tp: int, isl: int, osl: int, eff: Efficiency) -> tuple[float, float]:
    """(output tok/s, requests in the batch) at the highest rate the model still serves."""
    step, c = _setup(model, inst, tp, eff)
    w = from_distribution(f"isl={isl},osl={osl}")
    kv = step.kv_capacity_tokens()
    rate = capacity(c, step, w, kv, {}, 1.0)
    return rate * osl, predict(c, step, w, rate * 0.999, kv).extra["running_per_replica"]


def main() -> None:
    gpu = {H100: "H100", H200: "H200"}
    ratios = []
    print("Closed loop at a stated concurrency (NVIDIA NIM 1.8.0, Llama-3.3-70B = the 3.1-70B architecture, fp8)\n")
    print("| GPUs | ISL/OSL | c | ITL ms pub / pred | output tok/s pub / pred (FP8 KV) | ratio | pred with bf16 KV |")
    print("|---|---|---|---|---|---|---|")
    for _, model, inst, tp, isl, osl, c, itl, tps in CLOSED:
        p_itl, p_tps = closed_loop(model, inst, tp, isl, osl, c, FP8_KV)
        ratios.append(p_tps / tps)
        bf16 = closed_loop(model, inst, tp, isl, osl, c, BF16_KV)[1]
        print(f"| {tp}x{gpu[inst]} TP{tp} | {isl}/{osl} | {c} | {itl} / {p_itl:.1f} | {tps:,.0f} / {p_tps:,.0f} "
              f"| {p_tps / tps:.2f} | {bf16:,.0f} ({bf16 / tps:.2f}) |")
    print("\nMaximum throughput (TensorRT-LLM 1.0 perf overview, trtllm-bench, NVIDIA FP8 checkpoints)\n")
    print("| model | GPUs | ISL/OSL | output tok/s pub / pred (FP8 KV) | ratio | batch held | pred with bf16 KV |")
    print("|---|---|---|---|---|---|---|")
    for _, model, inst, tp, isl, osl, tps in SATURATED:
        p_tps, batch = saturated(model, inst, tp, isl, osl, FP8_KV)
        ratios.append(p_tps / tps)
        bf16 = saturated(model, inst, tp, isl, osl, BF16_KV)[0]
        print(f"| {model} | {tp}x{gpu[inst]} TP{tp} | {isl}/{osl} | {tps:,} / {p_tps:,.0f} | {p_tps / tps:.2f} "
              f"| {batch:.0f} | {bf16:,.0f} ({bf16 / tps:.2f}) |")
    within = sum(abs(r - 1) <= 0.25 for r in ratios)
    print(f"\n{within} of {len(ratios)} within 25%; ratios {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()

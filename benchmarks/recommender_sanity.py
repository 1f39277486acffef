"""The recommender's roofline against published serving figures (closed loop at a stated concurrency).

Each published point: model, hardware, format, tensor parallel, ISL/OSL, concurrency and its measured
ITL and output throughput. The prediction is the analytic model at the request rate a closed loop of
``c`` users produces (rate = c / E2E, iterated), with the catalogue's figures and the default
vLLM-like efficiency. Sources and dates are in docs/recommend.md.

    PYTHONPATH=. python benchmarks/recommender_sanity.py
"""

from __future__ import annotations

from fleetllm.recommend.candidate import Candidate
from fleetllm.recommend.catalogue import load_catalogue
from fleetllm.recommend.model_shape import CATALOGUE
from fleetllm.recommend.perf_model import Roofline
from fleetllm.recommend.queueing import predict
from fleetllm.recommend.workload import from_distribution

NIM = "NVIDIA NIM LLM benchmarking, Llama-3.3-70B-Instruct NIM 1.8.0 (docs.nvidia.com/nim/benchmarking/llm, 2026-07-20)"
# (source, model, instance, format, tp, isl, osl, concurrency, published ITL ms, published output tok/s)
POINTS = [
    (NIM, "llama-3.1-70b", "p5.48xlarge", "fp8", 2, 5000, 500, 1, 18.58, 51.67),
    (NIM, "llama-3.1-70b", "p5.48xlarge", "fp8", 2, 5000, 500, 5, 21.83, 218.48),
    (NIM, "llama-3.1-70b", "p5.48xlarge", "fp8", 2, 5000, 500, 25, 38.75, 623.4),
    (NIM, "llama-3.1-70b", "p5.48xlarge", "fp8", 2, 5000, 500, 50, 59.73, 814.37),
    (NIM, "llama-3.1-70b", "p5.48xlarge", "fp8", 2, 500, 2000, 1, 18.91, 52.85),
]


def closed_loop(model: str, inst: str, fmt: str, tp: int, isl: int, osl: int, users: int) -> tuple[float, float]:
    """(ITL ms, output tok/s) predicted for ``users`` in a closed loop."""
    cat = load_catalogue()
    step = Roofline(CATALOGUE[model], cat.instance(inst), cat.formats[fmt], tp)
    c = Candidate(cat.instance(inst), tp, cat.formats[fmt], 1, 256, 2048)  # a closed loop never queues for slots
    w = from_distribution(f"isl={isl},osl={osl}")
    rate = users / (osl * 0.02)
    for _ in range(30):
        p = predict(c, step, w, rate, step.kv_capacity_tokens())
        cycle = p.ttft_p50_ms / 1e3 + osl * p.itl_p50_ms / 1e3
        rate = 0.5 * rate + 0.5 * users / cycle
    return p.itl_p50_ms, rate * osl


def main() -> None:
    print("| model | hardware | ISL/OSL | c | ITL pub / pred ms | tok/s pub / pred | error |")
    print("|---|---|---|---|---|---|---|")
    for _, model, inst, fmt, tp, isl, osl, c, itl, tps in POINTS:
        p_itl, p_tps = closed_loop(model, inst, fmt, tp, isl, osl, c)
        print(f"| {model} | {tp}x {inst} {fmt} TP{tp} | {isl}/{osl} | {c} | {itl} / {p_itl:.1f} | {tps} / {p_tps:.0f} "
              f"| {(p_tps - tps) / tps:+.0%} |")


if __name__ == "__main__":
    main()

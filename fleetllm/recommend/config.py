"""``fleetllm recommend``'s settings (its flags are generated from this dataclass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleetllm.cli_options import opt


@dataclass
class RecommendConfig:
    """What to serve, the traffic and targets, and what to write."""

    model: str = opt("smollm2-135m", "a catalogue name (llama-3.1-8b, llama-3.1-70b, qwen3-30b-a3b, smollm2-135m), "
                                     "a HF id of one, a config.json or its directory, or a .gguf file")
    workload: str = opt("synthetic", "a `fleetllm bench` workload (synthetic, shared-prefix, multi-turn, agentic, "
                                     "long-short), isl=MEAN:STD,osl=MEAN:STD, or a capture directory")
    isl: float = opt(512, "bench workloads: input tokens (mean; per turn for multi-turn)")
    isl_std: float = opt(0, "bench workloads: input tokens' standard deviation")
    osl: float = opt(128, "bench workloads: output tokens (mean)")
    osl_std: float = opt(0, "bench workloads: output tokens' standard deviation")
    prefix_len: int = opt(1024, "shared-prefix: tokens of the shared system prompt")
    turns: float = opt(4, "multi-turn, agentic: turns per session")
    system_len: int = opt(0, "multi-turn: system prompt tokens")
    context_len: int = opt(4096, "agentic: initial context tokens")
    step_len: int = opt(256, "agentic: tool output tokens per turn")
    template_tokens: int = opt(0, "tokens the chat template adds to every prompt (SmolLM2-Instruct: 30, or 14 "
                                  "with a system prompt of its own)")
    slo: str = opt("ttft_p90_ms=2000,itl_p99_ms=200,e2e_p90_s=60",
                   "targets: ttft_p50_ms, ttft_p90_ms, itl_p50_ms, itl_p99_ms, e2e_p90_s (KEY=VALUE,...)")
    traffic: float | None = opt(None, "requests per second (open loop, Poisson)")
    users: int | None = opt(None, "concurrent users in a closed loop instead of --traffic")
    objective: Literal["cost", "throughput", "latency"] = opt(
        "cost", "cost: cheapest $/h meeting the SLOs; throughput: most tokens/s per GPU within them; latency: "
                "lowest E2E p90")
    kv_cache: Literal["bf16", "fp8"] = opt("bf16", "KV cache type on accelerators: bf16 (vLLM's default) or fp8 "
                                                   "(twice the tokens; TensorRT-LLM and NIM with FP8 checkpoints)")
    max_quality_loss: float = opt(1.0, "largest published or measured quality loss (%) of a weight format")
    catalogue: str | None = opt(None, "hardware catalogue YAML (default: fleetllm/recommend/hardware.yaml)")
    instances: list[str] = opt(doc="only these instance types (comma-separated)", factory=list)
    top: int = opt(10, "rows of the table")
    simulate_top: int = opt(3, "best candidates re-predicted by the fleet simulator (the real scheduler, virtual "
                               "time); 0: analytic only")
    sim_requests: int = opt(300, "requests per fleet simulation")
    validate: bool = opt(False, "deploy the best local candidates here, run `fleetllm bench`, report predicted "
                                "against measured")
    validate_top: int = opt(2, "--validate: local candidates to deploy")
    validate_simulated: bool = opt(False, "--validate with simulated workers (the calibrated profile) instead of real ones")
    validate_requests: int = opt(40, "--validate: measured requests per candidate")
    profile: str | None = opt(None, "timing profile of `fleetllm calibrate` for this machine's instances (default: the "
                                    "catalogue's); a profile of the very model recommended is used as measured")
    calibration: str | None = opt(None, "calibration.json of an earlier --validate: scales this machine's step "
                                        "times and adds its serving overhead")
    json: bool = opt(False, "print the result as JSON (machines)")
    out: str = opt("recommend-out", "directory for recommend.json, pareto.png and fleet.yaml")
    seed: int = opt(0, "seed of the workload samples and the simulations")

"""The engine's settings: one dataclass, each field a flag of ``fleetllm worker`` and ``fleetllm generate``.

Torch-free (the CLI builds its parsers, and the router and the simulated worker start, without loading torch).
The scheduler's knobs take their defaults from :class:`SchedulerConfig`, which owns them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleetllm.cli_options import opt
from fleetllm.engine.scheduler import SchedulerConfig
from fleetllm.kvtier.remote import kv_remote_value
from fleetllm.store.config import StoreConfig

# What --kv-cache-dtype auto means for an fp32 model on the fast path (quantised weights on the CPU): the cache
# that wins on speed while holding the fast-path quality bar (benchmarks/fast_path_quality.py; see
# docs/kv-cache-dtype.md#quality): int8 with a float16 scale per 8 channels, 15/16 in one batch and 14/16 prompt
# by prompt (goal 14 each), perplexity 1.0001x fp32's, at under a third of fp32's bytes (2026-12-06). Exact
# mode (--quantization none) keeps the model's dtype, so its outputs stay HF transformers' token for token.
FAST_PATH_KV_DTYPE = "int8"


@dataclass
class EngineConfig:
    """Engine knobs; each field is a flag of `fleetllm worker`, named as vLLM names it."""

    model: str = opt("smollm2-135m", "model alias, .gguf file, HF directory, hf://org/name[/file.gguf][@revision] "
                                     "or s3://bucket/prefix")
    served_model_name: str | None = opt(None, "name clients use (default: --model)")
    device: str = opt("auto", "auto | cpu | cuda (auto: cuda when present, else cpu)")
    block_size: int = opt(16, "tokens per KV block")
    num_blocks: int | None = opt(None, "KV blocks (default: from --kv-cache-gb)")
    kv_cache_gb: float = opt(1.0, "GiB of KV cache, when --num-blocks is not given")
    kv_offload_gb: float = opt(0.0, "GiB of host memory keeping KV blocks evicted from the cache, brought back "
                                    "instead of recomputed when a later prompt shares them (0: no such tier)")
    kv_offload_dtype: Literal["auto", "bf16", "fp8"] = opt(
        "auto", "how host memory (--kv-offload-gb) keeps KV blocks: auto (the KV cache's dtype: loaded back exactly), "
                "bf16 (half of fp32's bytes) or fp8 (e4m3 and a scale per token and KV head: about a quarter); a "
                "dtype no smaller than the cache's is not used")
    kv_disk_dir: str | None = opt(None, "folder of a disk tier behind the KV cache: every finished request's full "
                                        "blocks written there in the background, kept across restarts and brought "
                                        "back instead of recomputed (none: no disk tier)", metavar="DIR")
    kv_disk_gb: float = opt(16.0, "GiB the disk tier (--kv-disk-dir) may hold; the least recently used go first")
    kv_remote: str | None = opt(None, "Redis server shared by workers as a KV tier (redis://[:PASSWORD@]HOST:PORT or "
                                      "rediss://...): finished requests' blocks written there in the background, "
                                      "read by any worker of the same model (none: no shared tier; fleetllm serve "
                                      "and the fleet YAML: auto, one private redis-server shared with --state-url "
                                      "auto)",
                                parse=kv_remote_value, metavar="URL")
    kv_cache_dtype: Literal["auto", "fp32", "bf16", "fp16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"] = opt(
        "auto", f"dtype of the paged KV cache: auto ({FAST_PATH_KV_DTYPE} with quantised weights on the CPU, else "
                "the model's dtype), fp32, bf16 or fp16 (half fp32's bytes per token), "
                "int8, fp8 (= fp8_e4m3) or fp8_e5m2 (8 bits and a float16 scale per 8 channels of a token and KV head: "
                "under a third of fp32's bytes, read in place by the attention kernels); see docs/kv-cache-dtype.md")
    max_model_len: int | None = opt(None, "most tokens of one sequence, prompt and output (default: "
                                          "min(the model's context, 8192), capped by the KV cache)")
    max_num_seqs: int = opt(SchedulerConfig.max_num_seqs, "most sequences running in one step")
    max_num_batched_tokens: int = opt(SchedulerConfig.max_num_batched_tokens,
                                      "token budget of one step: prefill chunks, decode and verify tokens")
    max_waiting: int = opt(SchedulerConfig.max_waiting, "queue bound; beyond it requests get 503")
    scheduling_policy: Literal["fcfs", "priority"] = opt(
        SchedulerConfig.policy, "fcfs: first come, first served; priority: by each request's `priority` (lower "
                                "first, then arrival), the worst-ranked running request preempted first")
    priority_aging_s: float = opt(SchedulerConfig.priority_aging_s,
                                  "--scheduling-policy priority: seconds of waiting that improve a request's "
                                  "priority by one level, so none starves (0: no ageing)")
    urgent_step_rows: int | None = opt(
        SchedulerConfig.urgent_step_rows, "--scheduling-policy priority: the most rows of a less urgent priority a "
        "step carries while it computes a more urgent request's first token (the others wait that step, never two "
        "in a row: a shorter step, a sooner first token; docs/routing.md, \"Priorities and tenants\")", metavar="N")
    step_pause: bool = opt(True, "--scheduling-policy priority: a step of less urgent rows pauses between two layers "
                                 "when a more urgent request (priority <= 0) arrives, computes its prompt and resumes "
                                 "(its first token need not wait for the step; docs/routing.md, \"Priorities and "
                                 "tenants\"); the C decode stack's steps only", flag="--no-step-pause")
    enable_prefix_caching: bool = opt(True, "reuse the KV blocks of prompt prefixes computed before",
                                      flag="--no-prefix-caching")
    num_threads: int | None = opt(None, "torch threads (default: all cores)")
    quantization: Literal["none", "int4", "int4-int8", "q4", "q4-q8"] = opt(
        "q4", "q4 (default): on CPU, a GGUF's Q4_1 weights kept as they are, times activations rounded to int16 "
              "per group of 32 for steps under 7 tokens (integer dot products), the Q8_0 LM head with fp32 "
              "activations likewise; wider steps the same weights in bf16 where the CPU has AVX-512 BF16 (else fp32 "
              "from 256 tokens); fp32 for weights that are neither; q4-q8: int8 activations at every width "
              "(llama.cpp's arithmetic: faster, fails the greedy-agreement check); none: exact fp32 everywhere "
              "(equals HF transformers token for token); int4: int4 decoder / int8 LM-head weights for steps under "
              "8 tokens; int4-int8: int8 GEMMs for wider ones too (experimental: fails the greedy-agreement check)")
    batch_invariant: bool = opt(False, "the same kernels at every step width, so that a request's output does not "
                                       "change with what else is in the batch or with prefix-cache hits (beyond "
                                       "float rounding): q4's int16 GEMMs and Q8_0 head at every width, slower "
                                       "wide steps; none and q4-q8 only (none is invariant anyway)")
    speculative: str | dict | None = opt(
        "method=suffix", "speculative decoding: method ngram | suffix | eagle | peagle, k draft tokens (default k: "
                         "chosen per step from the measured verify cost and each request's acceptance, 0 where "
                         "drafting does not pay), adaptive=0 to fix K; none: off. Default: suffix drafting over "
                         "each agent session's history (docs/speculative.md)", metavar="method=M,k=N")
    enable_lora: bool = opt(False, "serve LoRA adapters (PEFT format) beside the base model: each request names "
                                   "its adapter, rows of different adapters and of the base share one step")
    max_loras: int = opt(4, "--enable-lora: adapters resident in the step's tables at once (a step holds requests "
                            "of at most this many adapters; others wait for a slot)")
    max_lora_rank: int = opt(64, "--enable-lora: the highest adapter rank accepted (higher ones are refused)")
    max_cpu_loras: int | None = opt(None, "--enable-lora: adapters kept in memory behind the resident ones, least "
                                          "recently used out first; the rest are read again from disk when needed "
                                          "(default: --max-loras)")
    metric_labels: dict[str, str] = opt(doc="worker identity on every metric: worker, role, zone, "
                                            "instance_type", factory=dict, cli=False)
    kv_pool_shared: bool = opt(False, "keep the host KV pool in a shared-memory file, so that prefill workers on this host "
                                      "write prompts' KV straight into its blocks (set from --kv-pool-shm and the role)",
                               cli=False)
    disable_metrics: bool = opt(False, "record no engine metrics (overhead baseline)")
    moe_expert_metrics: bool = opt(False, "mixture-of-experts models: also count the tokens routed to each expert of "
                                          "each layer (layers x experts series; the imbalance histogram is always on)")
    profile_steps: bool = opt(False, "time each step's phases (schedule, forward, attention, sampling, ...): "
                                     "LLMEngine.profile; a debugging aid, off costs nothing")
    store: StoreConfig = opt(doc="where hf:// and s3:// models are cached and how they are reached (its own flags)",
                             factory=StoreConfig, cli=False)

    def resolved_device(self) -> str:
        """``cuda`` or ``cpu`` for ``auto``; the device as given otherwise."""
        if self.device == "auto":
            import torch  # here, not at the top: the module stays torch-free

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

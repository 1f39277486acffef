"""How long one engine step takes on a replica: a roofline for accelerators, the measured profile here.

A step computes ``B`` decode tokens (each attending over its context) and ``P`` prompt tokens of
prefill chunks in one forward pass (fleetllm's token-budget scheduler). On an accelerator it takes

    linear + attention + all-reduces + overhead, per tensor-parallel rank, where
    linear    = max(2 · active params · tokens / (peak · compute_eff), weights read / (bandwidth · bandwidth_eff))
    attention = max(attention FLOPs / (peak · compute_eff), KV read / (bandwidth · bandwidth_eff))

The weight matrix multiplies and the attention are separate kernels that run one after the other, so
their times add; each is bound by compute or by memory on its own. Prefill is compute-bound, decode at
small batch reads every weight once per step and is bandwidth-bound, at large batch the KV of every
decoding sequence (read each step) dominates, and a mixture of experts reads only the experts its
tokens touch. The efficiency factors are what a vLLM-like engine
reaches (see docs/recommend.md for the published figures they were checked against). On this machine
the step time is the *measured* one, :class:`fleetllm.sim.profile.TimingProfile` from ``fleetllm
calibrate`` (the same model the simulated worker runs), scaled by active parameters for another model, plus,
for a mixture of experts, the reads of the experts a step's tokens touch beyond one token's.

Both classes answer ``step_seconds(num_decode, prefill_tokens, decode_context_tokens)``, the
TimingProfile's signature, so the fleet simulator runs either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from fleetllm.recommend.calibration import Calibration
from fleetllm.recommend.catalogue import Format, Instance
from fleetllm.recommend.kv_import import KvImport
from fleetllm.recommend.model_shape import ModelShape
from fleetllm.sim.profile import TimingProfile


class StepModel(Protocol):
    measured: bool  # step times from a measured profile (True) or the roofline (False)
    request_overhead_s: float  # the serving path's time before a request's first step (calibrated)
    kv_import: KvImport  # P/D: what a decode replica's import of a KV frame costs it

    def step_seconds(self, num_decode: int, prefill_tokens: int, decode_context_tokens: int = 0) -> float: ...


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak a vLLM-like engine reaches; fixed costs per step and per all-reduce."""

    compute: float = 0.6
    bandwidth: float = 0.8
    interconnect: float = 0.7
    step_overhead_s: float = 0.0015  # scheduling, sampling, launches (CUDA graphs) per step
    allreduce_latency_s: float = 8e-6  # NVLink; PCIe pays PCIE_LATENCY_S
    memory_utilization: float = 0.9  # of accelerator memory given to weights + KV (vLLM's default)
    activation_gb: float = 2.0  # per accelerator, kept free for activations and the CUDA context
    kv_cache_bytes: float = 2.0  # per KV value: bf16 is vLLM's default; 1.0 for an FP8 KV cache


PCIE_LATENCY_S = 25e-6
DEFAULT_EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class Roofline:
    """Modelled step times of ``shape`` in ``fmt`` on ``tp`` accelerators of ``instance``."""

    shape: ModelShape
    instance: Instance
    fmt: Format
    tp: int = 1
    eff: Efficiency = DEFAULT_EFFICIENCY
    measured: bool = False
    request_overhead_s: float = 0.0
    kv_import: KvImport = KvImport()  # a DMA into accelerator memory, beside the compute: not modelled

    @cached_property
    def weight_bytes(self) -> float:
        return self.shape.params * self.fmt.bytes

    @cached_property
    def kv_bytes_per_token(self) -> float:
        return self.shape.kv_bytes_per_token(self.eff.kv_cache_bytes)

    @cached_property
    def _peak_flops(self) -> float:
        return self.instance.peak_tflops(self.fmt.compute) * 1e12 * self.eff.compute

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache left on the replica after the weights (0: the weights do not fit)."""
        usable = self.tp * (self.instance.memory_gb * self.eff.memory_utilization - self.eff.activation_gb) * 2**30
        return max(0, int((usable - self.weight_bytes) / self.kv_bytes_per_token))

    def _weights_read(self, tokens: int) -> float:
        """Bytes of weights one step reads: all of a dense model; a MoE's shared part and touched experts."""
        return self.shape.params_read(tokens) * self.fmt.bytes

    def _allreduce_seconds(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        link = self.instance.interconnect_gbs * 1e9 * self.eff.interconnect
        latency = self.eff.allreduce_latency_s if self.instance.interconnect_gbs >= 100 else PCIE_LATENCY_S
        message = tokens * self.shape.hidden * 2.0
        return 2 * self.shape.layers * (latency + 2 * (self.tp - 1) / self.tp * message / link)

    def step_seconds(self, num_decode: int, prefill_tokens: int, decode_context_tokens: int = 0) -> float:
        tokens = num_decode + prefill_tokens
        if tokens <= 0:
            return 0.0
        s = self.shape
        peak = self._peak_flops * self.tp
        bandwidth = self.instance.bandwidth_gbs * 1e9 * self.eff.bandwidth * self.tp
        linear = max(2.0 * s.active_params * tokens / peak, self._weights_read(tokens) / bandwidth)
        attn_flops = s.attention_flops(decode_context_tokens) + prefill_tokens * s.attention_flops(prefill_tokens / 2)
        kv_read = (decode_context_tokens + prefill_tokens) * self.kv_bytes_per_token
        attention = max(attn_flops / peak, kv_read / bandwidth)
        return linear + attention + self._allreduce_seconds(tokens) + self.eff.step_overhead_s


@dataclass(frozen=True)
class Measured:
    """Step times of this machine from a measured profile, scaled to ``shape`` by its active weights.

    Exact (measured) when the profile is of this very model; scaled (modelled) otherwise.
    """

    profile: TimingProfile
    shape: ModelShape
    fmt: Format
    profiled: ModelShape | None = None  # the model the profile measured
    calibration: Calibration = Calibration()  # the serving path's share, from --validate
    memory_gb: float = 0.0  # the replica's memory, which every weight (every expert) must fit; 0: not checked

    @property
    def request_overhead_s(self) -> float:
        return self.calibration.request_overhead_s

    @property
    def measured(self) -> bool:
        return self.scale == 1.0 and self.fmt.bytes >= 4.0

    @property
    def kv_import(self) -> KvImport:
        """The decode side's import rate and steal as measured with the profile (bytes/s: any model's frames)."""
        return KvImport(self.profile.kv_import_bytes_per_s, self.profile.kv_import_steal)

    @property
    def scale(self) -> float:
        if self.profiled is None or self.profiled.name == self.shape.name:
            return 1.0
        return self.shape.active_params / self.profiled.active_params

    @property
    def weight_bytes(self) -> float:
        return self.shape.params * self.fmt.bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return self.shape.kv_bytes_per_token(4.0)  # fp32 KV on the CPU

    def kv_capacity_tokens(self) -> int:
        """The profile's KV pool, or 0 when the model's weights (all of them) do not fit the replica's memory."""
        if self.memory_gb and self.weight_bytes > self.memory_gb * 2**30:
            return 0
        return self.profile.num_blocks * self.profile.block_size

    def step_seconds(self, num_decode: int, prefill_tokens: int, decode_context_tokens: int = 0) -> float:
        t = self.profile.step_seconds(num_decode, prefill_tokens, decode_context_tokens) * self.scale
        t += self._expert_reads_seconds(num_decode + prefill_tokens)
        t *= self.calibration.step_scale
        if self.fmt.bytes < 4.0 and num_decode and not prefill_tokens:
            t *= 0.6  # int4 weights: the decode-step gain measured in docs/quantization.md, roughly
        return t


    def _expert_reads_seconds(self, tokens: int) -> float:
        """What a scaled step of a mixture of experts adds for reading more experts than one token's: the profile's
        fewest-sequence decode step (nearly all of it reading the profiled model's weights) per weight of it, times
        the weights read beyond the active ones (a step of 8 tokens of a top-8-of-64 model reads ~42 experts a layer,
        not 8). A profile of this very model measured that already."""
        s, p = self.shape, self.profiled
        if not s.experts or tokens <= 1 or self.scale == 1.0 or p is None:
            return 0.0
        extra = s.params_read(tokens) - s.params_read(1)
        return self.profile.overlap_s * extra / p.params_read(1)


def prefill_seconds(step: StepModel, tokens: int, chunk: int, num_decode: int = 0, context: int = 0) -> tuple[float, int]:
    """Time from a prompt's first chunk to its first token (``ceil(tokens/chunk)`` steps, each also running
    ``num_decode`` decodes over ``context`` tokens) and the number of steps."""
    if tokens <= 0:
        return step.step_seconds(max(num_decode, 1), 0, context), 1
    steps = math.ceil(tokens / chunk)
    full = step.step_seconds(num_decode, min(chunk, tokens), context)
    last = tokens - (steps - 1) * chunk
    return (steps - 1) * full + step.step_seconds(num_decode, last, context), steps

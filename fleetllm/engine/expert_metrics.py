"""How evenly a mixture-of-experts model's router spreads each step's tokens over its experts.

After every step each MoE layer's counts (tokens routed to each expert, every token counted ``k`` times) become one
observation of ``fleetllm_moe_expert_imbalance{layer}``: the busiest expert's count over the mean count, 1 when
every expert took the same share, ``E / k`` when every token of the step chose the same ``k`` experts. A layer
whose experts are unevenly loaded makes a step as slow as its busiest expert (on a CPU: reads the most expert
weights per token), which is what the histogram shows. ``--moe-expert-metrics`` adds
``fleetllm_moe_expert_tokens_total{layer, expert}``: per-expert counts are layers x experts series (48 x 128 for
a Qwen3-MoE 30B-A3B), too many to keep on by default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Histogram

if TYPE_CHECKING:
    from fleetllm.engine.metrics import EngineMetrics

IMBALANCE_BUCKETS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)


def moe_layers(model: Any) -> list[tuple[int, Any]]:
    """(layer index, its MoE module) of every mixture-of-experts layer of ``model`` (none for a dense one, or for
    no model: a simulated worker has none, and imports no torch)."""
    layers = getattr(model, "layers", None) or []
    if not layers:
        return []
    from fleetllm.models.moe import MoE

    return [(i, layer.mlp) for i, layer in enumerate(layers) if isinstance(getattr(layer, "mlp", None), MoE)]


def imbalance(counts: list[int]) -> float | None:
    """The busiest expert's count over the mean count (None when no token was routed)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else None


class ExpertLoadMetrics:
    """Turns the MoE layers' per-step counts into the imbalance histogram (and the per-expert counters)."""

    def __init__(self, layers: list[tuple[int, Any]], metrics: EngineMetrics, per_expert: bool) -> None:
        self.layers, self.metrics = layers, metrics
        labels = list(metrics.labels)
        hist = Histogram("fleetllm_moe_expert_imbalance", "Busiest expert's tokens over the mean, per MoE layer and step.",
                         [*labels, "layer"], buckets=IMBALANCE_BUCKETS, registry=metrics.registry)
        self.hist = {i: hist.labels(**metrics.labels, layer=str(i)) for i, _ in layers}
        self.tokens = None
        if per_expert:
            self.tokens = Counter("fleetllm_moe_expert_tokens", "Tokens routed to each expert (a token counts once per "
                                  "expert it chose).", [*labels, "layer", "expert"], registry=metrics.registry)

    @classmethod
    def of(cls, model: Any, metrics: EngineMetrics, per_expert: bool) -> ExpertLoadMetrics | None:
        layers = moe_layers(model)
        return cls(layers, metrics, per_expert) if layers else None

    def observe(self) -> None:
        """Take each layer's counts since the last call (the step just executed) and record them."""
        for i, moe in self.layers:
            counts, moe.expert_counts = moe.expert_counts, None
            if counts is None or not self.metrics.enabled:
                continue
            ratio = imbalance(counts)
            if ratio is not None:
                self.hist[i].observe(ratio)
            if self.tokens is not None:
                for e, n in enumerate(counts):
                    if n:
                        self.tokens.labels(**self.metrics.labels, layer=str(i), expert=str(e)).inc(n)

"""A request whose prompt was prefilled elsewhere: its KV already in this engine's pool, its first token sampled.

Disaggregated serving (:mod:`fleetllm.disagg`): a prefill worker computes the whole prompt, samples the
first token with the request's own parameters, and writes the prompt's KV into blocks of the decode
worker's pool (the last one partial when the prompt does not fill it). The decode worker's engine then
admits the request as if its own last prefill chunk had just run: blocks taken over, the prompt computed,
the first token appended through the same path as a sampled one (stops, grammar, metrics, streaming) and
decoding goes on from it. Outputs are the colocated path's: greedy rows are argmax of the same logits,
and a seeded request continues from the sampler state the first draw left (``sampler_state``).

Torch-free, like the engine's core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetllm.engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from fleetllm.engine.sequence import Sequence


@dataclass
class Handoff:
    """What the engine takes over for one prompt prefilled elsewhere."""

    token_ids: list[int]  # the prompt
    blocks: list[int]  # pool blocks holding its KV in order (the last partial unless the prompt fills it); held
    hashes: list[int]  # the full blocks' hashes (prefix-cache keys), as the engine's own caching would make them
    first_token: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    sampler_state: bytes | None = None  # a seeded request's sampling RNG state after the first draw
    lora_name: str | None = None  # the adapter its KV was computed with (None: the base model)

    def fits(self, prompt_token_ids: list[int], block_size: int, lora_name: str | None = None) -> bool:
        """Whether this handoff holds exactly ``prompt_token_ids``' KV (blocks enough, full ones hashed) as
        computed with adapter ``lora_name`` (another adapter's KV, or the base model's, is another prompt's)."""
        n = len(prompt_token_ids)
        return (self.token_ids == list(prompt_token_ids) and self.lora_name == lora_name
                and len(self.blocks) == -(-n // block_size)
                and len(self.hashes) == n // block_size)


def sampler_state(seq: Sequence) -> bytes | None:
    """A seeded request's sampling RNG state now (None: unseeded, or nothing drawn yet), to hand over."""
    return None if seq.generator is None else bytes(seq.generator.get_state().numpy().tobytes())

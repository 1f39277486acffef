"""A timing profile: how long the real engine takes for a step, measured by ``fleetllm calibrate``.

A step runs ``B`` decode sequences (each one token, attending over its context) and ``P`` prompt
tokens of prefill chunks in one forward pass. Its time is modelled as

    t = decode(B) + ctx_s_per_token · (context tokens of the decoding sequences) + prefill(P) − overlap

where ``decode`` and ``prefill`` interpolate measured points linearly (extrapolating from the last
two), and ``overlap`` is the fixed per-step cost counted twice when a step has both. The points are kept
as measured (each the median of ``sweeps`` calibration sweeps), not forced monotone: on one CPU thread a
decode step of 2-3 sequences really takes longer than one of 4.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fleetllm.router.policies import CostModel

PROFILES_DIR = Path(__file__).parent / "profiles"


def _interp(points: list[tuple[float, float]], x: float) -> float:
    if x <= 0:
        return 0.0
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1] * x / pts[0][0] if pts[0][0] else pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


@dataclass
class TimingProfile:
    model: str
    device: str
    threads: int
    block_size: int
    num_blocks: int
    prefill: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens in one chunk, seconds)
    decode: list[tuple[int, float]] = field(default_factory=list)  # (decoding sequences, seconds) at short context
    ctx_s_per_token: float = 0.0  # extra decode-step seconds per context token per sequence
    decode_context: int = 64  # context length at which ``decode`` was measured
    machine: str = ""
    # P/D: a decode worker's import of a KV frame (CRC, copy into fresh pool pages), bytes/s; 0 = not measured
    kv_import_bytes_per_s: float = 0.0
    kv_import_steal: float = 0.0  # of the import's seconds, the share decode steps beside it on its core lose
    sweeps: int = 0  # calibration sweeps each point is the median of (0: not recorded)

    def step_seconds(self, num_decode: int, prefill_tokens: int, decode_context_tokens: int = 0) -> float:
        t = 0.0
        if num_decode:
            t += _interp(self.decode, num_decode)
            extra = decode_context_tokens - num_decode * self.decode_context
            t += max(0.0, extra) * self.ctx_s_per_token
        if prefill_tokens:
            t += _interp(self.prefill, prefill_tokens)
            if num_decode:
                t -= min(self.overlap_s, t / 2)
        return t

    @property
    def overlap_s(self) -> float:
        """Fixed cost of a step, which a step with both prefill and decode pays once: the decode step of the
        fewest sequences measured (calibrate measures one: that step is nearly all fixed cost, reading the
        weights). Not the intercept of the first two points: small batches are not on a line here (a
        decode step of 2 sequences takes ~1.8x one of 1 on one CPU thread, which put the intercept near 0)."""
        if not self.decode:
            return 0.0
        return min(self.decode)[1]

    def cost_model(self) -> CostModel:
        """Router cost-model rates from this profile."""
        n, t = max(self.prefill)
        pts = sorted(self.decode)
        per_seq = (pts[-1][1] - pts[0][1]) / max(1, pts[-1][0] - pts[0][0]) if len(pts) > 1 else pts[0][1]
        return CostModel(prefill_tokens_per_s=n / t, decode_tokens_per_s=1.0 / max(per_seq, 1e-6),
                         decode_context_s=self.ctx_s_per_token)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TimingProfile:
        p = Path(path)
        if not p.exists() and (PROFILES_DIR / f"{path}.json").exists():
            p = PROFILES_DIR / f"{path}.json"
        d = json.loads(p.read_text())
        d["prefill"] = [tuple(x) for x in d["prefill"]]
        d["decode"] = [tuple(x) for x in d["decode"]]
        return cls(**d)

    @classmethod
    def default(cls) -> TimingProfile:
        """The profile shipped with fleetllm: SmolLM2-135M under the default quantization (q4), one CPU thread."""
        return cls.load(PROFILES_DIR / "smollm2-135m-cpu-1t.json")

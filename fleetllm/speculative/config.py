"""``--speculative method=peagle,k=4`` -> :class:`SpeculativeConfig`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from fleetllm.speculative.sessions import DEFAULT_TOKENS


@dataclass
class SpeculativeConfig:
    method: str = "ngram"  # a registered drafter: ngram | suffix | eagle | peagle
    k: int | None = None  # max draft tokens per step; None: chosen from the measured verify cost
    adaptive: bool = True  # per-request K from acceptance and cost (off: always draft k when possible)
    head: str | None = None  # eagle/peagle weights (default: the head shipped for the target)
    max_k: int = 8  # upper bound when k is chosen automatically
    session_tokens: int = DEFAULT_TOKENS  # suffix: tokens of agent sessions kept across turns (0: none)

    @classmethod
    def parse(cls, spec: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Accept ``"method=ngram,k=4"``, ``"ngram"``, a dict, a config, or None/"" (off)."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            spec = spec.strip()
            if not spec or spec == "none":
                return None
            items = {}
            for part in spec.split(","):
                key, sep, value = part.partition("=")
                if not sep:
                    key, value = "method", key
                items[key.strip()] = value.strip()
            spec = items
        known = {f.name for f in fields(cls)}
        unknown = set(spec) - known
        if unknown:
            raise ValueError(f"unknown --speculative keys {sorted(unknown)} (known: {sorted(known)})")
        cfg = cls()
        for key, value in spec.items():
            if key in ("k", "max_k"):
                value = None if value in (None, "", "auto") else int(value)
            elif key == "session_tokens":
                value = int(value)
            elif key == "adaptive":
                value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
            setattr(cfg, key, value)
        if cfg.method == "none":
            return None
        if cfg.session_tokens < 0:
            raise ValueError(f"speculative session_tokens must be 0 or more, got {cfg.session_tokens}")
        if cfg.k is not None and not 1 <= cfg.k <= 16:
            raise ValueError(f"speculative k must be in [1, 16], got {cfg.k}")
        return cfg

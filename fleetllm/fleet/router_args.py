"""The router flags that describe a fleet's models, wherever the router runs (this machine, a cluster).

Tokenizer, aliases, LoRA adapters, per-model policy, traffic splits between variants and the models scaled from
zero: what a router must know of each model beyond the workers it finds.
"""

from __future__ import annotations

from fleetllm.fleet.config import FleetConfig, ModelSpec


def model_router_args(cfg: FleetConfig, tokenizer: dict[int, str] | None = None) -> list[str]:
    """``--tokenizer``, ``--alias``, ``--adapter``, ``--model-policy``, ``--traffic`` and ``--scale-from-zero`` for
    ``cfg``.

    ``tokenizer`` maps ``id(model entry)`` to what the router loads the tokenizer from (a pinned source);
    default: the entry's source."""
    tokenizer = tokenizer or {}
    args: list[str] = []
    first: dict[str, ModelSpec] = {}
    for m in cfg.models:
        first.setdefault(m.served_name, m)  # variants share their tokenizer: the first entry's it is
    for name, m in first.items():
        args += ["--tokenizer", f"{name}={tokenizer.get(id(m), m.source)}"]
        args += [a for alias in m.aliases for a in ("--alias", f"{alias}={name}")]
        if m.policy:
            args += ["--model-policy", f"{name}={m.policy}"]
    for adapter, base in cfg.adapter_bases().items():
        args += ["--adapter", f"{adapter}={base}"]
    for name, split in cfg.traffic_splits().items():
        args += ["--traffic", f"{name}={split}"]
    zero = [m.served_name for m in cfg.models if m.replicas.min == 0]
    if zero:
        args += ["--scale-from-zero", ",".join(dict.fromkeys(zero))]
    return args

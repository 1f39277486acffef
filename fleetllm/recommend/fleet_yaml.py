"""The chosen candidate as a ``fleetllm serve`` fleet config (the ``models:`` schema of docs/fleet.md).

On this machine the YAML starts as is (``fleetllm serve --config``); for accelerator instances it names
the machines and per-copy accelerators, and says in a comment what fleetllm's engine does not do yet
(tensor parallel across accelerators, FP8/FP4 weights: use a checkpoint already in that format).
"""

from __future__ import annotations

from typing import Any

import yaml

from fleetllm.recommend.candidate import Candidate
from fleetllm.recommend.model_shape import ALIASES, ModelShape

HF_IDS = {v: k for k, v in ALIASES.items()}


def fleet_dict(c: Candidate, shape: ModelShape, simulate: bool = False, port: int = 8000) -> dict[str, Any]:
    """The fleet config of candidate ``c`` (``simulate``: timing-model copies, for a quick check here)."""
    local = c.instance.local
    source = shape.runs_here or (f"hf://{HF_IDS[shape.name]}" if shape.name in HF_IDS else shape.name)
    engine: dict[str, Any] = {"max_num_seqs": c.max_batch, "max_num_batched_tokens": max(c.chunk, c.max_batch)}
    if local:
        engine["num_threads"] = 1  # the measured profile is one thread per copy
        if c.fmt.name == "cpu-int4":
            engine["quantization"] = "int4"
    else:
        engine["device"] = "cuda"
    entry: dict[str, Any] = {"name": shape.name, "source": source, "engine": engine}
    if c.spec.on:
        entry["speculative"] = c.spec.engine_flag
    if simulate:
        entry["simulate"] = True
    if not local:
        entry["resources"] = {"accelerators": c.tp}
    if c.prefill_replicas:
        models = [{**entry, "role": "prefill", "replicas": c.prefill_replicas},
                  {**entry, "role": "decode", "replicas": c.replicas}]
    else:
        models = [{**entry, "replicas": c.replicas}]
    doc: dict[str, Any] = {"host": "127.0.0.1", "port": port, "policy": c.routing, "models": models}
    if c.prefill_replicas:
        doc["pd_threshold"] = c.pd_threshold
    if not local:
        doc["machines"] = [{"name": f"{c.instance.name}-{i}", "accelerators": c.instance.count,
                            "host": "127.0.0.1" if i == 0 else f"{c.instance.name}-{i}.internal"}
                           for i in range(c.instances)]
    return doc


def fleet_yaml(c: Candidate, shape: ModelShape, simulate: bool = False, port: int = 8000) -> str:
    notes = [f"# fleetllm recommend: {c.label()}",
             f"# {c.instances} x {c.instance.name} at ${c.instance.price_per_hour}/h ({c.instance.price_date})"]
    if not c.instance.local:
        notes.append(f"# weights: {c.fmt.name} (serve a checkpoint in that format)")
    if c.tp > 1:
        notes.append(f"# tensor parallel {c.tp}: needs an engine that shards a copy (fleetllm's runs one accelerator "
                     "per copy)")
    return "\n".join(notes) + "\n" + yaml.safe_dump(fleet_dict(c, shape, simulate, port), sort_keys=False)

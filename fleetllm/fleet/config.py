"""Fleet configuration: from ``fleetllm serve`` flags or a YAML file.

Example (every key optional)::

    host: 127.0.0.1
    port: 8000
    policy: kv_aware            # round_robin | least_load | session | prefix | kv_aware
    restart: true               # restart a worker process that dies
    router_args: [--max-retries, "3"]
    workers:
      - replicas: 2
        model: smollm2-135m
        zone: zone-a
        args: [--max-num-seqs, "32"]
      - replicas: 30
        simulate: true          # timing-model workers, many per process
        zone: zone-b
    external: [http://10.0.0.5:8001]   # workers started elsewhere (a cluster)
    pd_threshold: 2048          # with prefill-role workers: disaggregate long uncached prompts
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class WorkerGroup:
    replicas: int = 1
    model: str = "smollm2-135m"
    simulate: bool = False
    zone: str = ""
    role: str = "both"  # prefill | decode | both (real workers)
    threads: int | None = None  # torch threads per real worker (default: cores shared evenly)
    args: list[str] = field(default_factory=list)  # extra `fleetllm worker` flags


@dataclass
class FleetConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    worker_port: int | None = None  # first worker port (default: port + 1)
    policy: str = "kv_aware"
    workers: list[WorkerGroup] = field(default_factory=lambda: [WorkerGroup()])
    external: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    restart: bool = False
    pd_threshold: int | None = None  # router: disaggregate above this many uncached prompt tokens (default 4096)
    log_dir: str | None = None
    otlp_endpoint: str | None = None  # OTLP/HTTP collector: the router and every worker push to it
    startup_timeout_s: float = 300.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FleetConfig:
        d = dict(d)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown fleet config keys: {', '.join(sorted(unknown))}")
        groups = []
        for g in d.pop("workers", None) or [{}]:
            bad = set(g) - set(WorkerGroup.__dataclass_fields__)
            if bad:
                raise ValueError(f"unknown worker keys: {', '.join(sorted(bad))}")
            groups.append(WorkerGroup(**{**g, "args": [str(a) for a in g.get("args", [])]}))
        d["router_args"] = [str(a) for a in d.get("router_args", [])]
        return cls(workers=groups, **d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> FleetConfig:
        return cls.from_dict(yaml.safe_load(Path(path).read_text()) or {})

    @property
    def num_workers(self) -> int:
        return sum(g.replicas for g in self.workers) + len(self.external)

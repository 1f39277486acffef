"""Fleet configuration: the models a fleet serves, the machines it may use, and the router in front.

A fleet serves one or more models; each model is an *inference component* in SageMaker's sense: its own
source, engine settings, resources per copy, copy count (``min``/``max``/``initial``) and zones. ``fleetllm
serve --config`` places the copies onto ``machines`` (fleetllm/fleet/placement.py) and starts them. Every key
is optional; the smallest config is ``models: [{source: smollm2-135m}]``. Example::

    host: 127.0.0.1
    port: 8000
    policy: kv_aware                  # the default routing policy; a model may set its own
    restart: true                     # restart a worker process that dies (the default)
    machines:                         # default: this machine, all its cores and memory, zone "local"
      - {name: a, cores: 1, memory_gb: 8, zone: zone-a}
      - {name: b, cores: 1, memory_gb: 8, zone: zone-b}
    models:
      - name: smollm2                 # what clients send as `model`
        aliases: [smollm2-135m]
        source: smollm2-135m          # alias, .gguf file or HF directory
        engine: {max_num_seqs: 32, kv_cache_gb: 0.5}   # `fleetllm worker` engine settings
        speculative: method=suffix
        resources: {cores: 1, memory_gb: 2}
        replicas: {min: 1, max: 4, initial: 2}         # or a plain count
        autoscale: {ttft_p90_s: 2.0, down_window_s: 120}  # fleetllm/fleet/autoscaler.py ScalingPolicy
        zones: [zone-a, zone-b]       # copies spread across these
        policy: session
        adapters:                     # LoRA adapters served by every copy (each its own `model` name), docs/lora.md
          - {name: support-bot, source: hf://acme/support-lora@v3}
          - {name: sql, source: s3://adapters/sql, token_env: SQL_HF_TOKEN}
      - name: coder                   # one model as two variants: 95% stable, 5% canary (sticky per session)
        variant: stable
        source: /models/coder-v1
        traffic: 95
      - name: coder
        variant: canary               # its own copies, autoscaling and fleetllm_router_variant_* metrics
        source: /models/coder-v2
        traffic: 5
      - name: chat-sim
        source: smollm2-135m
        simulate: true                # timing-model copies (no weights), many per process
        replicas: 30
    external: [http://10.0.0.5:8001]  # workers started elsewhere (a cluster)
    ray: {address: auto}              # copies as actors on a Ray cluster (fleetllm/fleet/ray_launcher.py)
    keys_file: keys.yaml              # API keys on (fleetllm keys create --file keys.yaml ...)
    pd_threshold: 2048                # with prefill copies: disaggregate long uncached prompts
    capture:                          # inference data capture (docs/capture.md; --capture-* flags)
      destination: s3://bucket/captures
      sampling: {endpoint: 10, worker: 10}
    identity: {aws_role_arn: "arn:aws:iam::123456789012:role/router"}  # Kubernetes: the router's cloud role;
                                      # a model's own `identity:` too (fleetllm/fleet/cluster.py)
    domain: llm.example.com           # Kubernetes: the router's Ingress (TLS, external-dns), docs/scale-out.md
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from fleetllm.capture.config import CaptureConfig
from fleetllm.errors import UsageError, existing_file, unknown_key, yaml_error
from fleetllm.fleet.autoscaler import ScalingPolicy
from fleetllm.fleet.cluster import Domain, Identity
from fleetllm.lora.modules import LoraModule, check_name
from fleetllm.router.state_url import fleet_state_url_value
from fleetllm.store.uri import ModelURI

ROLES = ("both", "prefill", "decode")


@dataclass
class Machine:
    """A machine copies can be placed on. Only local ones (host 127.0.0.1) are started by ``fleetllm serve``."""

    name: str = "local"
    cores: int | None = None  # default: os.cpu_count()
    memory_gb: float | None = None  # default: the machine's physical memory
    accelerators: int = 0
    zone: str = "local"
    host: str = "127.0.0.1"


@dataclass
class Resources:
    """What one copy of a model needs. ``cores: None`` shares the machine's cores evenly (the laptop case)."""

    cores: int | None = None
    memory_gb: float | None = None  # default: 2 GiB for a real copy (weights + 1 GiB of KV), 0.05 for a simulated one
    accelerators: int = 0
    custom: dict[str, float] = field(default_factory=dict)  # Ray custom resources, e.g. {"instance:m7i": 1}


@dataclass
class RaySettings:
    """``ray:``: run every copy as an actor on a Ray cluster instead of as a process of this machine.

    ``machines`` are then ignored: the cluster's nodes are the machines, and Ray places each copy on one with
    the copy's ``resources`` free (cores -> CPUs, memory, accelerators -> GPUs, ``custom`` as they are)."""

    address: str = "auto"  # "auto" (the cluster this machine belongs to) or the head's HOST:PORT
    namespace: str = "fleetllm"  # the router finds the fleet's actors by name in this Ray namespace
    strategy: str = "SPREAD"  # Ray scheduling strategy: SPREAD (copies over as many nodes as possible) or DEFAULT
    zone_label: str = "zone"  # the node label that names a node's zone (`ray start --labels`)


@dataclass
class Replicas:
    """How many copies of a model run: ``initial`` at start, the autoscaler keeps it within ``min``..``max``."""

    min: int = 1
    max: int | None = None  # default: initial
    initial: int | None = None  # default: max(min, 1)

    def __post_init__(self) -> None:
        if self.initial is None:
            self.initial = max(self.min, 1)
        if self.max is None:
            self.max = max(self.initial, self.min)
        if not 0 <= self.min <= self.initial <= self.max:
            raise UsageError(f"replicas need 0 <= min <= initial <= max, got min={self.min} "
                             f"initial={self.initial} max={self.max}")


@dataclass
class AdapterSpec:
    """A LoRA adapter of a model: what clients send as ``model``, and where its files come from (a local directory,
    ``hf://org/name[@revision]`` or ``s3://bucket/prefix``: pinned at deploy, fetched by each copy through the
    store, with the adapter's own token, never the model's)."""

    name: str
    source: str
    token_env: str | None = None
    token_file: str | None = None

    def module(self) -> LoraModule:
        """The ``--lora-modules`` entry of this adapter."""
        return LoraModule(self.name, self.source, token_env=self.token_env, token_file=self.token_file)


@dataclass
class ModelSpec:
    """One model of the fleet: where it comes from, how its engine runs, and how many copies of it."""

    source: str = "smollm2-135m"  # alias, .gguf file, HF directory, hf://org/name[@revision] or s3://bucket/prefix
    name: str | None = None  # served name (default: the source)
    aliases: list[str] = field(default_factory=list)  # other names clients may send as `model`
    engine: dict[str, Any] = field(default_factory=dict)  # engine settings, e.g. {max_num_seqs: 32}
    speculative: str | None = None  # e.g. "method=suffix"
    resources: Resources = field(default_factory=Resources)
    replicas: Replicas = field(default_factory=Replicas)
    autoscale: ScalingPolicy = field(default_factory=ScalingPolicy)  # used when replicas.min < replicas.max
    zones: list[str] = field(default_factory=list)  # copies spread across these (default: any machine)
    policy: str | None = None  # routing policy for this model (default: the fleet's)
    role: str = "both"  # prefill | decode | both: a disaggregated model has a prefill and a decode entry
    simulate: bool = False  # timing-model copies (no weights)
    variant: str | None = None  # entries sharing a name are variants of one model (a canary), each with its copies
    traffic: float = 1.0  # this variant's weight in its model's traffic split (sticky per session)
    identity: Identity | None = None  # Kubernetes: the cloud role this model's pods act as (IRSA / Pod Identity)
    adapters: list[AdapterSpec] = field(default_factory=list)  # LoRA adapters every copy serves

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise UsageError(f"model {self.served_name!r}: role must be one of {', '.join(ROLES)}, not {self.role!r}")
        taken = {self.served_name, *self.aliases}
        for a in self.adapters:
            where = f"model {self.served_name!r}: adapter {a.name!r}"
            check_name(a.name, where)
            if a.name in taken:
                raise UsageError(f"{where}: the name is already the model's or another adapter's")
            taken.add(a.name)
            if "://" in a.source:
                ModelURI.parse(a.source)
        if self.resources.memory_gb is None:
            self.resources.memory_gb = 0.05 if self.simulate else 2.0

    @property
    def served_name(self) -> str:
        return self.name or self.source

    @property
    def unit(self) -> str:
        """What is placed and scaled on its own: the served name, with the variant and a P/D role if any."""
        role = "" if self.role == "both" else f":{self.role}"
        return f"{self.served_name}{'@' + self.variant if self.variant else ''}{role}"

    @property
    def autoscaled(self) -> bool:
        return self.replicas.min < self.replicas.max

    def worker_args(self) -> list[str]:
        """The ``fleetllm worker`` flags for this model's engine settings and speculation."""
        args = []
        for key, value in self.engine.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                args.append(flag)
            elif value is not False and value is not None:
                args += [flag, str(value)]
        if self.speculative:
            args += ["--speculative", self.speculative]
        if self.adapters:
            args += [] if self.engine.get("enable_lora") else ["--enable-lora"]
            args += ["--lora-modules", *(a.module().as_json() for a in self.adapters)]
        return args


@dataclass
class FleetConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    worker_port: int | None = None  # first worker port (default: port + 1)
    policy: str = "kv_aware"
    models: list[ModelSpec] = field(default_factory=lambda: [ModelSpec()])
    machines: list[Machine] = field(default_factory=lambda: [Machine()])
    external: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    restart: bool = True  # restart worker processes that die (a dead engine exits non-zero)
    keys_file: str | None = None  # API keys on: the router admits only keys of this file (fleetllm keys)
    admin_token_file: str | None = None  # the router's admin token (default: admin-token in log_dir), read or minted
    # the router's shared state (its --state-url: redis://HOST:PORT), or "auto": a private redis-server started
    # and stopped with the fleet; several routers (or fleets) given one store enforce each key's limits together
    state_url: str | None = None
    pd_threshold: int | str | None = None  # router: disaggregate above this many uncached prompt tokens (default
    # 4096), or "auto": when the router expects the P/D path to delay requests less (fleetllm/disagg/pd_auto.py)
    log_dir: str | None = None
    otlp_endpoint: str | None = None  # OTLP/HTTP collector: the router and every worker push to it
    startup_timeout_s: float = 300.0
    capture: CaptureConfig = field(default_factory=CaptureConfig)  # the router's and every worker's
    ray: RaySettings | None = None  # copies as Ray actors (``fleetllm serve --ray``)
    identity: Identity | None = None  # Kubernetes: the router's cloud role (a capture bucket, say)
    domain: Domain | None = None  # Kubernetes: the router's public host name (Ingress, TLS, external-dns)

    def __post_init__(self) -> None:
        if self.state_url is not None:
            self.state_url = fleet_state_url_value(str(self.state_url))
        names: dict[str, str] = {}
        for m in self.models:
            for n in [m.served_name, *m.aliases, *dict.fromkeys(a.name for a in m.adapters)]:
                if names.get(n, m.served_name) != m.served_name:
                    raise UsageError(f"model name {n!r} is used by two models ({names[n]!r} and {m.served_name!r})")
                names[n] = m.served_name
        units = [m.unit for m in self.models]
        dup = next((u for u in units if units.count(u) > 1), None)
        if dup is not None:
            raise UsageError(f"model {dup!r} is listed twice: give each entry of one model its own `variant`")
        for name in dict.fromkeys(m.served_name for m in self.models):
            entries = [m for m in self.models if m.served_name == name]
            if any(m.variant for m in entries) and not all(m.variant for m in entries):
                raise UsageError(f"model {name!r}: either every entry names its `variant` or none does")
            if any(not 0 <= m.traffic < float("inf") for m in entries) or not sum(m.traffic for m in entries) > 0:
                raise UsageError(f"model {name!r}: `traffic` weights must be non-negative, and one positive")

    def traffic_splits(self) -> dict[str, str]:
        """``{model: "variant:weight,..."}`` for every model served as variants (the router's ``--traffic``)."""
        splits: dict[str, dict[str, float]] = {}
        for m in self.models:
            if m.variant:
                splits.setdefault(m.served_name, {})[m.variant] = m.traffic
        return {name: ",".join(f"{v}:{w:g}" for v, w in ws.items()) for name, ws in splits.items()}

    def adapter_bases(self) -> dict[str, str]:
        """Every LoRA adapter's name -> its base model's served name (the router's ``--adapter``)."""
        return {a.name: m.served_name for m in self.models for a in m.adapters}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FleetConfig:
        """The fleet a YAML document describes; a key no schema has, at any level, is refused by its path
        (``models[0].enginee``) with the nearest valid key (UsageError)."""
        d = _checked(cls, d, "")
        if "models" in d:
            d["models"] = [_model(m, f"models[{i}]") for i, m in enumerate(_listed(d["models"], "models"))]
        if "machines" in d:
            d["machines"] = [Machine(**_checked(Machine, m, f"machines[{i}]"))
                             for i, m in enumerate(_listed(d["machines"], "machines"))]
        d["router_args"] = [str(a) for a in d.get("router_args", [])]
        if "capture" in d:
            d["capture"] = CaptureConfig.from_dict(d["capture"], "capture")
        if d.get("ray") is not None:  # `ray: auto` or `ray: {address: ..., namespace: ...}`
            r = d["ray"]
            d["ray"] = RaySettings(address=r) if isinstance(r, str) else RaySettings(**_checked(RaySettings, r, "ray"))
        if d.get("identity") is not None:
            d["identity"] = Identity(**_checked(Identity, d["identity"], "identity"))
        if d.get("domain") is not None:  # `domain: llm.example.com` or `domain: {host: ..., cluster_issuer: ...}`
            h = d["domain"]
            d["domain"] = Domain(host=h) if isinstance(h, str) else Domain(**_checked(Domain, h, "domain"))
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> FleetConfig:
        """The fleet of a YAML file; any mistake in it is one line naming the file (UsageError)."""
        p = existing_file(path, "fleet YAML")
        try:
            return cls.from_dict(yaml.safe_load(p.read_text()) or {})
        except yaml.YAMLError as e:
            raise yaml_error(path, e) from None
        except UsageError as e:
            raise UsageError(f"{path}: {e}") from None

    @classmethod
    def single_model(cls, source: str, replicas: int, simulate: bool = False, prefill: int = 0, decode: int = 0,
                     threads: int | None = None, speculative: str | None = None,
                     cores: int | None = None) -> FleetConfig:
        """The fleet ``fleetllm serve`` flags describe: one model, ``replicas`` copies (or prefill + decode ones).

        ``threads`` is torch threads per copy, not reserved cores: a laptop may run more copies than cores.
        ``cores`` reserves that many cores per copy, each copy pinned to its own."""
        engine = {"num_threads": threads} if threads and not simulate else {}
        common = dict(source=source, engine=engine, speculative=None if simulate else speculative, simulate=simulate,
                      resources=Resources(cores=cores))
        if prefill or decode:
            models = [ModelSpec(role="prefill", replicas=Replicas(min=prefill), **common),
                      ModelSpec(role="decode", replicas=Replicas(min=decode), **common)]
        else:
            models = [ModelSpec(replicas=Replicas(min=replicas), **common)]
        return cls(models=[m for m in models if m.replicas.initial])

    @property
    def num_workers(self) -> int:
        return sum(m.replicas.initial for m in self.models) + len(self.external)


def _checked(cls: type, d: Any, where: str) -> dict[str, Any]:
    """``d`` as a dict whose keys are all fields of ``cls``; ``where`` is its path in the file (``models[0]``,
    ``""`` for the top level), which an error names with the key."""
    return dict(checked_keys(d, {f.name for f in fields(cls)}, where))


def checked_keys(d: Any, known: set[str], where: str) -> dict[str, Any]:
    """``d`` if it is a mapping of ``known`` keys only; else a UsageError naming the key's path and the nearest
    valid key."""
    if not isinstance(d, dict):
        raise UsageError(f"`{where or 'the file'}` must be a mapping (key: value), not {d!r}")
    for key in d:
        if key not in known:
            raise UsageError(unknown_key(f"{where}.{key}" if where else str(key), known))
    return d


def worker_settings() -> set[str]:
    """What a model's ``engine:`` may set: every ``fleetllm worker`` flag, as :meth:`ModelSpec.worker_args`
    spells it (``max_num_seqs`` for ``--max-num-seqs``)."""
    from fleetllm.cli import worker_flags

    return {flag.removeprefix("--").replace("-", "_") for flag in worker_flags()}


def _listed(items: Any, where: str) -> list[Any]:
    if items is None:
        return []
    if not isinstance(items, list):
        raise UsageError(f"`{where}` must be a list (- item), not {items!r}")
    return items


def _model(d: Any, where: str) -> ModelSpec:
    d = _checked(ModelSpec, d, where)
    if "resources" in d:
        d["resources"] = Resources(**_checked(Resources, d["resources"], f"{where}.resources"))
    if "autoscale" in d:
        d["autoscale"] = ScalingPolicy(**_checked(ScalingPolicy, d["autoscale"], f"{where}.autoscale"))
    if "engine" in d:
        checked_keys(d["engine"], worker_settings(), f"{where}.engine")
    if "replicas" in d:
        r = d["replicas"]
        d["replicas"] = Replicas(min=r, initial=r, max=r) if isinstance(r, int) \
            else Replicas(**_checked(Replicas, r, f"{where}.replicas"))
    for key in ("aliases", "zones"):
        if isinstance(d.get(key), str):
            d[key] = [d[key]]
    if d.get("identity") is not None:
        d["identity"] = Identity(**_checked(Identity, d["identity"], f"{where}.identity"))
    if "adapters" in d:
        d["adapters"] = [_adapter(a, f"{where}.adapters[{i}]") for i, a in enumerate(_listed(d["adapters"],
                                                                                              f"{where}.adapters"))]
    return ModelSpec(**d)


def _adapter(d: Any, where: str) -> AdapterSpec:
    d = _checked(AdapterSpec, d, where)
    missing = [k for k in ("name", "source") if not isinstance(d.get(k), str) or not d[k]]
    if missing:
        raise UsageError(f"`{where}` needs {' and '.join(missing)} (an adapter is {{name: NAME, source: PATH}})")
    return AdapterSpec(**d)

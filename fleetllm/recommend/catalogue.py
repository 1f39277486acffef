"""The hardware catalogue: instances, their accelerators and prices, and the weight formats they can run.

It is a data file (``hardware.yaml`` beside this module, or the user's own) so that prices and new
instances change without code. Figures are per accelerator; an instance has ``count`` of them. A data
type missing from ``tflops`` runs at the next wider one the accelerator has (fp4 -> fp8 -> bf16 -> fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from fleetllm.errors import UsageError, did_you_mean, existing_file

DEFAULT_CATALOGUE = Path(__file__).parent / "hardware.yaml"
WIDER = {"fp4": "fp8", "fp8": "bf16", "int8": "bf16", "bf16": "fp32", "fp32": None}


@dataclass(frozen=True)
class Format:
    """How weights (and KV) are stored, what the math runs in, and what quality it costs."""

    name: str
    bytes: float  # per weight, scales included
    compute: str  # the data type of the matrix multiplies
    quality_loss_pct: float
    source: str = ""


@dataclass(frozen=True)
class Instance:
    """One instance type: ``count`` identical accelerators (or cores, for a CPU machine)."""

    name: str
    accelerator: str
    count: int
    memory_gb: float  # per accelerator
    bandwidth_gbs: float  # per accelerator
    tflops: dict[str, float]
    interconnect_gbs: float
    network_gbps: float
    price_per_hour: float
    price_date: str
    price_source: str
    local: bool = False  # this machine: candidates on it can be validated by measurement
    profile: str | None = None  # measured timing profile (fleetllm/sim/profiles) for this machine

    @property
    def is_cpu(self) -> bool:
        return self.accelerator == "cpu"

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak for ``dtype``, or for the next wider type the hardware has."""
        t: str | None = dtype
        while t is not None:
            if t in self.tflops:
                return self.tflops[t]
            t = WIDER.get(t)
        return min(self.tflops.values())

    def runs_natively(self, dtype: str) -> bool:
        return dtype in self.tflops


@dataclass(frozen=True)
class Catalogue:
    instances: list[Instance]
    formats: dict[str, Format] = field(default_factory=dict)
    path: str = ""

    def instance(self, name: str) -> Instance:
        for i in self.instances:
            if i.name == name:
                return i
        raise KeyError(f"no instance {name!r} in {self.path}; known: {', '.join(i.name for i in self.instances)}")

    def select(self, names: list[str]) -> list[str]:
        """The instance types ``names`` ask for: each an instance type (``p5.48xlarge``) or an accelerator, which
        stands for every instance with it (``H100``, ``RTX PRO 6000``: the leading words of the catalogue's
        ``H100 SXM``, ``RTX PRO 6000 Blackwell``; any case). A name that matches nothing is refused listing
        what would (UsageError)."""
        chosen: list[str] = []
        for name in names:
            found = [i.name for i in self.instances if i.name == name or _names_accelerator(name, i.accelerator)]
            if not found:
                types, accelerators = [i.name for i in self.instances], list(dict.fromkeys(i.accelerator
                                                                                           for i in self.instances))
                raise UsageError(f"--instances {name!r}: no such instance type or accelerator in {self.path}"
                                 f"{did_you_mean(name, types + accelerators)} (instance types: {', '.join(types)}; "
                                 f"accelerators: {', '.join(accelerators)})")
            chosen += [n for n in found if n not in chosen]
        return chosen


def with_profile(cat: Catalogue, profile: str | None) -> Catalogue:
    """``cat`` with this machine's instances (``local``) timed by ``profile`` (a ``fleetllm calibrate`` output)
    instead of the catalogue's own; unchanged when ``profile`` is None."""
    if not profile:
        return cat
    instances = [replace(i, profile=profile) if i.local else i for i in cat.instances]
    return replace(cat, instances=instances)


def _names_accelerator(name: str, accelerator: str) -> bool:
    """``name``'s words are the leading words of ``accelerator`` (``H100`` of ``H100 SXM``, not of ``H200``)."""
    asked, words = name.lower().split(), accelerator.lower().split()
    return bool(asked) and words[:len(asked)] == asked


def load_catalogue(path: str | Path | None = None) -> Catalogue:
    """The catalogue at ``path`` (default: the shipped ``hardware.yaml``); refuses unknown keys by name."""
    p = existing_file(path, "--catalogue") if path else DEFAULT_CATALOGUE
    doc = yaml.safe_load(p.read_text()) or {}
    formats = {name: Format(name=name, **_known(Format, d, f"format {name}")) for name, d in (doc.get("formats") or {}).items()}
    instances = [Instance(**_known(Instance, d, f"instance {d.get('name', '?')}")) for d in doc.get("instances") or []]
    if not instances:
        raise ValueError(f"{p}: no instances")
    return Catalogue(instances, formats, str(p))


def _known(cls: type, d: dict[str, Any], what: str) -> dict[str, Any]:
    names = set(cls.__dataclass_fields__)
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"{what}: unknown keys {', '.join(sorted(unknown))}")
    out = dict(d)
    if "tflops" in out:
        out["tflops"] = {str(k): float(v) for k, v in out["tflops"].items()}
    if "price_date" in out:
        out["price_date"] = str(out["price_date"])
    return out

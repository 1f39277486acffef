"""Which C kernels this process runs, and what it costs when one it should have is missing.

A kernel is *expected* when this CPU has what its fast path needs (:func:`fleetllm.kernels.variants.expected_variant`);
it is *missing* when it is expected and not loaded, or loaded from a lesser variant than the CPU runs (a wheel
without this CPU's build). An engine on the CPU checks once at start (:func:`check`): every missing kernel is
one ERROR line naming it, the cause and the cost; ``FLEETLLM_REQUIRE_KERNELS=1`` makes it fatal (CI sets it),
and the statuses go to ``/metrics`` (``fleetllm:kernel_available``), ``/ready`` and ``fleetllm doctor``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetllm.kernels.variants import KERNELS, expected_variant

if TYPE_CHECKING:
    from fleetllm.kernels.build import KernelLibrary

log = logging.getLogger(__name__)
REQUIRE_ENV = "FLEETLLM_REQUIRE_KERNELS"


class KernelsMissing(RuntimeError):
    """A kernel this CPU should run is missing and ``FLEETLLM_REQUIRE_KERNELS=1`` asks for all of them."""


@dataclass(frozen=True)
class KernelStatus:
    """One kernel in this process: the variant loaded (None: none), the one this CPU should run (None: the CPU
    lacks its instruction set, so it is not needed), why it failed to load, and what going without it costs."""

    kernel: str
    variant: str | None
    expected: str | None
    error: str | None
    cost: str

    @property
    def missing(self) -> bool:
        """Expected here but not running as this CPU could (not loaded, or a lesser variant)."""
        return self.expected is not None and self.variant != self.expected

    def problem(self) -> str:
        """One line for a person: which kernel, why it is missing and what that costs."""
        why = self.error or f"loaded the {self.variant} build where this CPU runs the {self.expected} one"
        return f"C kernel {self.kernel} unavailable ({why}): {self.cost}"


def details(found: list[KernelStatus]) -> dict[str, dict[str, str]]:
    """The kernels this CPU should run as ``/ready`` shows them: ``{"kernels": {name: variant or "missing"}}``,
    plus ``"missing_kernels": {name: why and what it costs}`` when any is missing; empty when none is expected
    (a simulated worker, a GPU)."""
    expected = [s for s in found if s.expected is not None]
    if not expected:
        return {}
    out = {"kernels": {s.kernel: "missing" if s.missing else str(s.variant) for s in expected}}
    if missing := {s.kernel: s.problem() for s in expected if s.missing}:
        out["missing_kernels"] = missing
    return out


def libraries() -> dict[str, KernelLibrary]:
    """Every kernel's library, by kernel name (imports the modules that declare them)."""
    from fleetllm.kernels import attention, bf16, decode_stack, lora, moe_experts, prefill, q4, q4_int, q8

    libs = [m.LIBRARY for m in (q4_int, decode_stack, attention, q4, q8, moe_experts, bf16, prefill, lora)]
    return {lib.name: lib for lib in libs}


def statuses(wait: bool = True) -> list[KernelStatus]:
    """Each kernel's status (``wait``: loads or builds every one first), in :data:`KERNELS`' order."""
    libs = libraries()
    for lib in libs.values():
        lib.get(wait=False)  # start every load at once: first-use builds run side by side
    out = []
    for name, kernel in KERNELS.items():
        lib = libs[name]
        if wait:
            lib.get(wait=True)
        out.append(KernelStatus(name, lib.variant, expected_variant(name), lib.error, kernel.cost))
    return out


def require_kernels() -> bool:
    """Whether a missing kernel is fatal (``FLEETLLM_REQUIRE_KERNELS=1``)."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def check() -> list[KernelStatus]:
    """Load every kernel and say, at ERROR, each one missing; raise :class:`KernelsMissing` when that is fatal."""
    found = statuses(wait=True)
    missing = [s for s in found if s.missing]
    for s in missing:
        log.error("%s", s.problem())
    if missing and require_kernels():
        raise KernelsMissing(f"{REQUIRE_ENV}=1 and {len(missing)} C kernel(s) missing: "
                             + "; ".join(s.problem() for s in missing))
    return found

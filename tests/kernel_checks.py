"""A kernel test's precondition: skip where this CPU lacks the kernel's instruction set, FAIL where it has it and
the kernel did not load (a build that broke must not pass as a skip)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from fleetllm.kernels.variants import expected_variant

if TYPE_CHECKING:
    from fleetllm.kernels.build import KernelLibrary


def require_kernels(*libraries: KernelLibrary) -> None:
    """Load each library; skip the test when the CPU runs none of them, fail when one it runs is missing."""
    for lib in libraries:
        lib.get(wait=True)
        expected = expected_variant(lib.name)
        if expected is None:
            pytest.skip(f"this CPU lacks the instruction set {lib.name} needs")
        if lib.lib is None or lib.variant != expected:
            pytest.fail(f"this CPU runs {lib.name}'s {expected} build, but {lib.variant or 'none'} loaded: {lib.error}")

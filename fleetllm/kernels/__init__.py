"""Compute kernels that PyTorch's eager ops do badly on this path: paged attention read in place (decode and prefill).

Each kernel has a PyTorch reference (the eager backend, and the tests' oracle) and native backends chosen at
run time (:mod:`fleetllm.kernels.attention`); native code comes prebuilt per instruction-set variant in a wheel,
or is built on first use in a checkout (:mod:`.build`, :mod:`.variants`); :mod:`.health` says which run.

The names below load :mod:`.attention` (and torch) when first asked for: the torch-free parts of this package
(:mod:`.variants`, :mod:`.health`) serve a simulated worker and ``fleetllm doctor`` without it.
"""

from __future__ import annotations

from typing import Any

_ATTENTION = ("chunk_rows", "kernel_ready", "paged_attention", "paged_decode_attention", "reference_attention",
              "set_kernel_enabled")
__all__ = [*_ATTENTION, "wait_for_kernels"]


def __getattr__(name: str) -> Any:
    if name in _ATTENTION:
        from fleetllm.kernels import attention

        return getattr(attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def wait_for_kernels() -> None:
    """Build (or load) every C kernel now: for measurements that must not start on the eager fallback."""
    from fleetllm.kernels.health import statuses

    statuses(wait=True)

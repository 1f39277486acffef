"""Compute kernels that PyTorch's eager ops do badly on this path: paged attention read in place (decode and prefill).

Each kernel has a PyTorch reference (the eager backend, and the tests' oracle) and native backends chosen at
run time (:mod:`fleetllm.kernels.attention`); native code is built on first use (:mod:`.build`).
"""

from fleetllm.kernels.attention import (
    chunk_rows,
    kernel_ready,
    paged_attention,
    paged_decode_attention,
    reference_attention,
    set_kernel_enabled,
)

__all__ = ["chunk_rows", "kernel_ready", "paged_attention", "paged_decode_attention", "reference_attention",
           "set_kernel_enabled", "wait_for_kernels"]


def wait_for_kernels() -> None:
    """Build (or load) every C kernel now: for measurements that must not start on the eager fallback."""
    from fleetllm.kernels import attention, bf16, decode_stack, prefill, q4, q4_int, q8

    for library in (attention.LIBRARY, bf16.LIBRARY, decode_stack.LIBRARY, prefill.LIBRARY, q4.LIBRARY, q4_int.LIBRARY,
                    q8.LIBRARY):
        library.get(wait=True)

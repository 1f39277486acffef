"""Compute kernels that PyTorch's eager ops do badly on this path: paged attention read in place.

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
           "set_kernel_enabled"]

"""The KV transfer's settings: each field a flag of ``fleetllm worker``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleetllm.cli_options import opt


@dataclass
class TransferOptions:
    """How a prefill worker ships KV blocks to decode workers, and whether a decode worker's pool takes them directly."""

    kv_transfer_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2"] = opt(
        "auto", "dtype of K and V in transfer frames; auto: the KV cache's own (exact; an 8-bit cache's rows with "
                "their scales). float16 or bfloat16 halve an fp32 cache's bytes, int8 or fp8 quarter them, but "
                "decode then reads rounded KV: outputs may differ from a local prefill's")
    kv_pool_shm: Literal["auto", "on", "off"] = opt(
        "auto", "keep the KV pool in a shared-memory file that prefill workers on this host write prompts' KV "
                "straight into (no frame, no copy after the prefill); auto: on for --role decode; on: any role; "
                "either only when /dev/shm has room for the whole pool (else private memory, frames as before)")

    def shares_pool(self, role: str) -> bool:
        """Whether a worker of ``role`` keeps its KV pool in a shared-memory file."""
        return self.kv_pool_shm == "on" or (self.kv_pool_shm == "auto" and role == "decode")

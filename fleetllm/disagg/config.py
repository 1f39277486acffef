"""The KV transfer's settings: each field a flag of ``fleetllm worker`` (used by prefill workers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleetllm.cli_options import opt


@dataclass
class TransferOptions:
    """How a prefill worker ships KV blocks to decode workers."""

    kv_transfer_dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "dtype of K and V in transfer frames; auto: the KV cache's own (exact). float16 or bfloat16 "
                "halve an fp32 cache's bytes, but decode then reads rounded KV: outputs may differ from a "
                "local prefill's")

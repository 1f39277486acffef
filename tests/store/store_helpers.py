"""Helpers of the store tests."""

from __future__ import annotations

import os
from pathlib import Path

GATED_TOKEN = "hf_TESTtoken-9f2c41d7e0b35a86c1"  # a made-up token of the gated test repo: tests grep for it


def greedy(loaded) -> list[int]:  # noqa: ANN001 - a LoadedModel
    """16 greedy tokens of a chat answer from an engine over ``loaded``."""
    import torch

    from fleetllm.engine.llm import LLM
    from fleetllm.engine.sampling import SamplingParams

    threads = torch.get_num_threads()
    try:  # one thread: two OpenMP threads on cores shared with other jobs stall each other (10x slower here)
        llm = LLM(loaded=loaded, num_blocks=32, num_threads=1)
        res = llm.chat([{"role": "user", "content": "Name three rivers of Europe."}],
                       SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    finally:
        torch.set_num_threads(threads)
    return res.outputs[0].token_ids




def rot(path: Path) -> None:
    """Flip bytes of ``path`` the way a media error does: its inode, size and mtime stay as they were."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        flipped = bytes(b ^ 0xFF for b in f.read(8))
        f.seek(st.st_size // 2)
        f.write(flipped)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

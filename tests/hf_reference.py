"""HF transformers as the suite's reference for the embedded model, in a background process of its own.

Loading SmolLM2 into transformers from its GGUF (converting the 49k-token vocabulary, dequantising and
renaming every tensor) costs ~40 s of CPU on this kind of machine. The suite starts this process at the
session's start, niced, so that the load overlaps other tests instead of waiting in front of the few that
compare against it; they ask it questions over a pipe, one JSON line each way.

Run as a script, it is that process: it loads the tokenizer and the model, then answers requests from
stdin until stdin closes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any

SCRIPT = os.path.abspath(__file__)


class HFReference:
    """The client: :meth:`call` sends one request and waits for its answer (the first waits for the load)."""

    def __init__(self) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - kept for error reports
        self._proc = subprocess.Popen(
            [sys.executable, SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True, preexec_fn=lambda: os.nice(10))
        self._lock = threading.Lock()

    def call(self, op: str, **args: Any) -> Any:
        """Send ``op`` with ``args``; return its answer or raise with the process's error output."""
        with self._lock:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            try:
                self._proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
                self._proc.stdin.flush()
                line = self._proc.stdout.readline()
            except BrokenPipeError:
                line = ""
            if not line:
                self._stderr.seek(0)
                raise RuntimeError(f"HF reference process ended: {self._stderr.read()[-3000:]}")
            answer = json.loads(line)
            if "error" in answer:
                raise RuntimeError(f"HF reference: {answer['error']}")
            return answer["result"]

    def stop(self) -> None:
        """Close its stdin (it exits) and reap it."""
        if self._proc.stdin:
            self._proc.stdin.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()


def _serve() -> None:
    from pathlib import Path

    import torch
    import transformers

    from fleetllm.models.loader import resolve

    torch.set_num_threads(1)  # a background peer on a 2-core machine
    path = Path(resolve("smollm2-135m"))
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    def predict(sequences: list[list[int]], starts: list[int]) -> list[list[int]]:
        """Teacher forcing: the argmax at each position from ``start - 1`` to the end's predecessor."""
        with torch.no_grad():
            return [model(torch.tensor([s])).logits[0, st - 1 : len(s) - 1].argmax(-1).tolist()
                    for s, st in zip(sequences, starts, strict=True)]

    def generate(prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
        return out[0, len(prompt):].tolist()

    ops = {"encode": lambda texts: [tok.encode(t) for t in texts], "predict": predict, "generate": generate}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            answer = {"result": ops[req.pop("op")](**req)}
        except Exception as e:  # noqa: BLE001 - reported to the test that asked
            answer = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()

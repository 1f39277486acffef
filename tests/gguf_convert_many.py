"""Runs llama.cpp's ``convert_hf_to_gguf.py`` over several models in one process: its imports (torch, its
``conversion`` package, gguf-py: ~4 s of CPU) are paid once instead of once a model.

Usage: ``python gguf_convert_many.py CONVERTER MODEL_DIR OUTTYPE OUTFILE [MODEL_DIR OUTTYPE OUTFILE ...]``.
The script's own ``main()`` converts each, as ``python convert_hf_to_gguf.py MODEL_DIR --outtype OUTTYPE --outfile
OUTFILE`` would; a failed conversion ends the process with its status.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    script, jobs = Path(argv[0]), argv[1:]
    if not jobs or len(jobs) % 3:
        raise SystemExit("usage: gguf_convert_many.py CONVERTER (MODEL_DIR OUTTYPE OUTFILE)...")
    sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
    converter = runpy.run_path(str(script))  # defines its main() without running it (not run as __main__)
    for model_dir, outtype, outfile in zip(jobs[0::3], jobs[1::3], jobs[2::3], strict=True):
        sys.argv = [str(script), model_dir, "--outtype", outtype, "--outfile", outfile]
        converter["main"]()


if __name__ == "__main__":
    main(sys.argv[1:])

"""Prototype for issue 19 item 1b: a plain-C batch-1 int4 GEMV against ATen's int4 GEMM, per call.

SmolLM2-135M's four decoder GEMM shapes (qkv, o, gate_up, down) at batch 1: ATen's
``_weight_int4pack_mm_for_cpu`` (what ``--quantization int4`` runs, bf16 activations) against the C
prototype in ``benchmarks/prototypes/int4_gemv.c`` (fp32 activations, its own nibble layout, called through
ctypes), and a step's 30 layers of each. Also checks the C result against the dequantised weights.

    python benchmarks/int4_gemv.py
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetllm.kernels.build import build  # noqa: E402
from fleetllm.models.quant import GROUP, quantize_int4  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = w.shape
    wg = w.reshape(n, k // GROUP, GROUP)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((wg - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    return packed, scale.contiguous(), (lo + 8 * scale).contiguous()


def median_us(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    lib = ctypes.CDLL(str(build(Path(__file__).with_name("prototypes") / "int4_gemv.c")))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.int4_gemv.argtypes = [p, p, p, p, p, i, i, i]
    print(f"load {os.getloadavg()[0]:.1f}\n| GEMM | N×K | ATen int4 µs | C int4 µs | ratio | max rel err |\n|---|---|---|---|---|---|")
    aten_total = c_total = 0.0
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        x = torch.randn(1, k)
        packed_aten, sz = quantize_int4(w)
        xb = x.to(torch.bfloat16)
        packed, scale, zero = pack(w)
        y = torch.empty(n)
        aten = median_us(lambda xb=xb, w=packed_aten, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w, GROUP, sz))
        args = (x.data_ptr(), packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), y.data_ptr(), n, k, 2)
        c = median_us(lambda args=args: lib.int4_gemv(*args))
        nibbles = torch.cat([(packed & 15).view(n, k // 32, 16), (packed >> 4).view(n, k // 32, 16)], -1)
        deq = ((nibbles.float() - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).reshape(n, k)
        want = x @ deq.t()
        err = ((y - want[0]).abs().max() / want.abs().max()).item()
        aten_total += aten * 30
        c_total += c * 30
        print(f"| {name} | {n}×{k} | {aten:.0f} | {c:.0f} | {aten / c:.2f}× | {err:.1e} |")
    print(f"| 30 layers | | {aten_total / 1e3:.1f} ms | {c_total / 1e3:.1f} ms | {aten_total / c_total:.2f}× | |")
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""KV transfer throughput into a real decode worker: frame bytes/s over HTTP and over shared memory,
against a plain memory copy of the same bytes (``benchmarks/disaggregation.py --transfer``)."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import free_ports  # noqa: E402

from fleetllm.disagg import frame  # noqa: E402
from fleetllm.disagg.routes import SHM_DIR  # noqa: E402
from fleetllm.engine.block_pool import hash_prefix_blocks  # noqa: E402
from fleetllm.fleet.config import FleetConfig, ModelSpec, Replicas  # noqa: E402
from fleetllm.fleet.launcher import Fleet  # noqa: E402


def transfer_throughput(num_blocks: int, repeats: int, out_dir: Path) -> dict:
    """Frame bytes/s into a real decode worker over HTTP and shm, and a memory copy of the same bytes."""
    models = [ModelSpec(source="smollm2-135m", role="decode", replicas=Replicas(min=1), engine={"num_threads": 1})]
    fleet = Fleet(FleetConfig(port=free_ports(2), models=models, log_dir=str(out_dir / "logs" / "transfer")))
    fleet.start()
    url = fleet.worker_urls[0]
    try:
        results: dict[str, list[float]] = {"http": [], "shm": [], "memcpy": [], "encode+decode": []}
        nbytes = 0
        for r in range(repeats):
            tokens = [(r * 7919 + i * 31) % 40000 + 100 for i in range(num_blocks * 16)]  # fresh blocks each time
            hashes = hash_prefix_blocks(tokens, 16, b"smollm2-135m")
            header = frame.FrameHeader("smollm2-135m", 30, 3, 64, "float32", 16, tokens, hashes)
            layers = [(torch.randn(num_blocks, 16, 3, 64), torch.randn(num_blocks, 16, 3, 64)) for _ in range(30)]
            t0 = time.perf_counter()
            data = b"".join(frame.encode(header, layers))
            frame.decode(data)
            results["encode+decode"].append(time.perf_counter() - t0)
            nbytes = len(data)
            src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            t0 = time.perf_counter()
            src.clone()
            results["memcpy"].append(time.perf_counter() - t0)
            for via in ("http", "shm"):
                if via == "shm":
                    tokens2 = [t + 1 for t in tokens]
                    header.token_ids, header.block_hashes = tokens2, hash_prefix_blocks(tokens2, 16, b"smollm2-135m")
                    d = b"".join(frame.encode(header, layers))
                    path = SHM_DIR / f"fleetllm-kv-{uuid.uuid4().hex}"
                    t0 = time.perf_counter()
                    path.write_bytes(d)
                    resp = httpx.post(url + "/pd/kv", json={"shm": str(path)}, timeout=120)
                else:
                    t0 = time.perf_counter()
                    resp = httpx.post(url + "/pd/kv", content=data, headers={"content-type": "application/octet-stream"},
                                      timeout=120)
                results[via].append(time.perf_counter() - t0)
                assert resp.status_code == 200 and resp.json()["imported"] > 0, resp.text
    finally:
        fleet.stop()
    best = {k: min(v) for k, v in results.items()}
    return {"bytes": nbytes, "blocks": num_blocks, **{f"{k}_GBps": nbytes / v / 1e9 for k, v in best.items()}}

